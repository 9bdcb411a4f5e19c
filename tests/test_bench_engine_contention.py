"""bench/bench_engine_contention.py on the CPU device: its plumbing end to end (server processes,
engine load, streaming, latency, byte checks, JSON), and its byte check catching one wrong byte."""

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_engine_contention as bec  # noqa: E402


def test_cpu_run_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_engine_contention.py"), "--device", "cpu", "--quick", "--layouts", "mla-packed",
         "--loads", "gemm", "--window", "0.3", "--small-requests", "5", "--big-requests", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "byte-exact: ALL PASS" in proc.stdout
    r = json.loads(out.read_text())
    assert r["failures"] == []
    assert r["server_exit_codes"] == {"cpu": 0}
    assert set(r["ceilings_gbps"]["mla-packed"]) == {"d2h", "h2d", "both"}
    rows = {(x["path"], x["load"]): x for x in r["results"]}
    assert set(rows) == {(p, ld) for p in ("server", "engine", "in-process") for ld in ("idle", "gemm")}
    for row in rows.values():
        for op in ("store", "retrieve"):
            assert row["transfers"][op]["gbps"] > 0 and row["transfers"][op]["requests"] >= 1
        for n in ("1ch", "4ch"):
            for op in ("store", "retrieve"):
                v = row["latency"][n][op]
                assert 0 < v["p50"] <= v["p99"]
        if row["load"] == "gemm":
            e = row["engine"]
            assert all(math.isfinite(e[k]) and e[k] > 0 for k in ("alone_before", "loaded", "alone_after", "ratio"))
    assert rows[("server", "idle")]["transfer_mode"] == "cpu"
    assert rows[("server", "idle")]["registered_layout"] == "packed"  # vLLM's block-outermost views: one cache
    assert rows[("in-process", "idle")]["transfer_mode"] == "in-process copy"


def test_byte_check_catches_one_wrong_byte(shm_files):
    args = types.SimpleNamespace(device="cpu", chunks=1, mha_layers=2, mla_layers=2)
    failures = []
    lr = bec.LayoutRun("mha", args, failures)
    src, dst = lr.src[0], lr.dst
    for t in lr.kv:
        t[:, dst] = t[:, src]
    lr.check(src, dst, "copied")
    assert failures == []
    lr.kv[1].view(torch.int16)[1, dst[3], 5, 2, 7] += 1  # one byte pair of one block
    lr.check(src, dst, "flipped")
    assert len(failures) == 1 and "flipped: WRONG BYTES in layer 1" in failures[0]
    del lr


def test_byte_check_covers_every_layer_of_a_packed_cache(shm_files):
    args = types.SimpleNamespace(device="cpu", chunks=1, mha_layers=3, mla_layers=2)
    failures = []
    lr = bec.LayoutRun("mha-packed", args, failures)
    src, dst = lr.src[0], lr.dst
    lr.whole[dst] = lr.whole[src]
    lr.check(src, dst, "copied")
    assert failures == []
    lr.whole.view(torch.int16)[dst[2], 2, 3, 1, 9] += 1  # layer 2 of one block
    lr.check(src, dst, "flipped")
    assert len(failures) == 1 and "flipped: WRONG BYTES in layer 2" in failures[0]
    del lr
