"""lmcache-mp-bench (lmcache_mp.loadgen.cli) against a server running in this process."""

import json
import socket

import pytest

import lmcache_mp
from lmcache_mp.loadgen import cli as loadgen


@pytest.fixture
def server():
    srv = lmcache_mp.Server(lmcache_mp.ServerConfig(url="tcp://127.0.0.1:0", l1_size="512MiB", device="cpu",
                                                    chunk_size=64))
    srv.start()
    yield srv
    srv.stop()


def test_two_workers_store_and_retrieve_every_byte(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = loadgen.main(["--url", server.url, "--workers", "2", "--device", "cpu", "--layers", "2",
                       "--heads", "2", "--head-size", "64", "--block-size", "16", "--chunks", "4",
                       "--requests", "2", "--lookups", "20", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["workers"] == 2
    assert row["mismatches"] == 0
    assert row["requested_chunks"] == row["stored_chunks"] == row["loaded_chunks"] == 2 * 2 * 4
    assert row["store_GBps"] > 0 and row["retrieve_GBps"] > 0
    assert row["store_ms_p50"] > 0 and row["lookup_us_p99"] > 0
    assert 0 < row["bare_rt_us_p50"] <= row["bare_rt_us_p99"]  # the echo process's round trip, beside the lookups
    assert "the bare round trip's own p99" in printed.out
    assert "store GB/s" in printed.out and "x D2H" not in printed.out  # no ceiling, no ratio columns
    assert server.engine.status()["registrations"] == []  # the workers unregistered their caches
    # progress while it runs: each phase once both workers finished it, with the counts of both,
    # and what the slow ones wait for once the first worker begins them (its report may overtake
    # another worker's of the phase before: each process sends its own)
    lines = [line.split(" s  ", 1)[1] for line in printed.out.splitlines() if line.startswith("  ") and " s  " in line]
    begun = [line for line in lines if line.startswith("(")]
    assert [line for line in lines if line not in begun] == [
        "registered: 2 KV caches, 72 blocks", "store: 4 requests, 16 chunks",
        "lookup: 40 lookups, 40 bare round trips", "retrieve: 4 requests, 16 chunks",
        "verify: 16 chunks checked, 0 missing, 0 mismatching",
        "requests after idle gaps: 10 lookups, 10 retrieves"], printed.out
    assert begun == ["(register: each worker fills its KV cache with random bytes and registers it with the server)",
                     "(verify: each worker retrieves every request again and compares it with what it stored, "
                     "bit for bit)"], printed.out
    assert lines.index(begun[0]) < lines.index("registered: 2 KV caches, 72 blocks")
    assert lines.index(begun[1]) < lines.index("verify: 16 chunks checked, 0 missing, 0 mismatching")


def test_trace_times_every_other_request_and_the_others_give_the_latencies(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = loadgen.main(["--url", server.url, "--device", "cpu", "--layers", "2", "--heads", "2", "--head-size", "64",
                       "--block-size", "16", "--chunks", "1", "--requests", "6", "--lookups", "8", "--trace",
                       "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["mismatches"] == 0 and row["loaded_chunks"] == 6
    stages = row["trace_us"]["store"]
    # segments join stamps in time order, and the client's "client sent" (after its send call
    # returned) may come after the server's first stamps on a loaded machine: check the stamps
    stamps = {s for name in stages if name != "whole request" for s in name.split(" -> ")}
    assert {"call", "client sent", "received", "planned", "copied", "returned"} <= stamps, stages
    tails = row["trace_p99_us"]["store"]
    assert tails.keys() == stages.keys() and all(tails[k] >= stages[k] for k in stages)
    # a segment may occur in only some of the traces (stamps swap places), so its median may
    # exceed the median whole request; never the slowest whole request
    assert tails["whole request"] >= max(v for k, v in stages.items() if k != "whole request") > 0
    assert "trace of store (3 requests" in printed.out and "trace of lookup (4 requests" in printed.out
    assert row["store_ms_p50"] > 0 and row["lookup_us_p50"] > 0
    assert row["machine_stalls"] == {} and "stall probe" not in printed.out  # only when asked for: it takes a core


def test_no_server_is_a_clear_error_at_once(capsys):
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    t0 = time.monotonic()
    rc = loadgen.main(["--url", url, "--connect-timeout", "60"])
    assert rc != 0 and time.monotonic() - t0 < 30  # (it waited the whole connect timeout)
    err = capsys.readouterr().err
    assert f"no server at {url}: nothing listens there" in err, err
    assert f"(start one with: lmcache-mp-server --url {url})" in err, err


SMALL = ["--layers", "2", "--heads", "2", "--head-size", "64", "--block-size", "16", "--chunks", "4"]


@pytest.mark.parametrize("prompts, requests", [(6, 60), (64, 150)], ids=["fits", "overflows"])
def test_mix_of_two_layouts_reports_hit_ratios_next_to_an_ideal_lru(tmp_path, capsys, prompts, requests):
    """Two layouts at once, as engines use the server. When both working sets fit, every repeat is
    a hit (as for the ideal LRU); when they do not, the hit ratio stays close to the ideal's."""
    srv = lmcache_mp.Server(lmcache_mp.ServerConfig(url="tcp://127.0.0.1:0", l1_size="16MiB", device="cpu",
                                                    chunk_size=64)).start()
    out = tmp_path / "mix.json"
    try:
        rc = loadgen.main(["--url", srv.url, *SMALL, "--mix", "mla:2", "--prompts", str(prompts),
                           "--requests", str(requests), "--skew", "0.8", "--json", str(out)])
    finally:
        srv.stop()
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "ideal LRU" in printed.out and "x ideal" in printed.out
    assert f"100% of the requests: {2 * requests} requests" in printed.out  # progress, both workers'
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["llama3-8b:2", "mla:2"]
    assert [r["object_bytes"] for r in rows] == [2 * 2 * 64 * 2 * 64 * 2, 2 * 64 * 576 * 2]
    for r in rows:
        assert r["requests"] == requests and r["chunks"] == 4 * requests
        assert r["missing"] == 0 and r["mismatches"] == 0
        if prompts == 6:
            assert r["hits"] == r["ideal_hits"] > 0 and r["evicted"] == 0
        else:  # 2.5x the L1 in all: the ideal LRU misses too, and we stay close to it
            assert r["evicted"] > 0 and r["ideal_hit_ratio"] < 0.7
            assert r["hit_ratio"] >= 0.9 * r["ideal_hit_ratio"], r


def test_slow_requests_checked_against_a_stall_probe_and_requests_after_idle_gaps(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = loadgen.main(["--url", server.url, "--device", "cpu", "--layers", "2", "--heads", "2", "--head-size", "64",
                       "--block-size", "16", "--chunks", "1", "--requests", "6", "--lookups", "8", "--trace",
                       "--stall-probe", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert row["machine_stalls"]["seconds"] > 0  # the probe watched the run
    for kind, timed in (("store", 3), ("lookup", 4), ("retrieve", 3)):
        tails = row["tails"][kind]
        assert tails["p50_ms"] > 0 and all(ms > 2 * tails["p50_ms"] for _, _, ms, *_ in tails["slow"])
        assert len(result["runs"][0]["workers_detail"][0]["spans_ns"][kind]) == timed
    for kind in ("lookup", "retrieve"):
        idle = row["idle_us"][kind]
        assert idle["whole_us"] > 0 and idle["hot_us"] > 0
    assert len(row["trace_slowest"]["store"]) == 3
    assert "stall probe" in printed.out and "retrieve after 5 idle gaps" in printed.out


def test_trace_quantiles_never_put_a_tail_below_its_median():
    """Segments are named by the stamps on either side, and a client's and the server's stamps may
    swap places on a busy machine: a segment can then occur in two traces of three. Its p99 must
    still be at least its median (nearest rank, rounded up), and every row has both."""
    from lmcache_mp.loadgen.trace import summarize

    us = 1000
    traces = [
        [("call", 0), ("client sent", 10 * us), ("received", 20 * us), ("returned", 100 * us)],
        [("call", 0), ("received", 5 * us), ("client sent", 30 * us), ("returned", 40 * us)],
        [("call", 0), ("received", 8 * us), ("client sent", 9 * us), ("returned", 400 * us)],
    ]
    medians, tails = dict(summarize(traces)), dict(summarize(traces, 0.99))
    assert medians.keys() == tails.keys()
    assert medians["call -> received"] == 6.5 and tails["call -> received"] == 8  # two values: the larger
    assert all(tails[k] >= medians[k] for k in medians)
    assert (medians["whole request"], tails["whole request"]) == (100, 400)
    assert dict(summarize(traces[:1], 0.99)) == dict(summarize(traces[:1]))  # one trace: both are it


def test_slow_requests_are_lined_up_with_what_they_met():
    from lmcache_mp.loadgen.tails import attribute

    ms = 1_000_000
    spans = [(i * 10 * ms, i * 10 * ms + ms) for i in range(10)]  # 1 ms each, 10 ms apart
    spans[3] = (30 * ms, 34 * ms)  # slow: meets the probe's stall
    spans[6] = (60 * ms, 63 * ms)  # slow: meets a collection of the worker and one of the server
    spans[8] = (80 * ms, 83 * ms)  # slow: meets nothing
    stalls = [(5 * ms, 2 * ms), (31 * ms, ms // 2), (32 * ms, ms)]
    t = attribute([(spans, [(61 * ms, ms // 4, 0)])], stalls, server_gc=[(62 * ms, ms // 10, 1)])
    assert t["p50_ms"] == 1.0
    assert [(w, i, ms_) for w, i, ms_, *_ in t["slow"]] == [(0, 3, 4.0), (0, 6, 3.0), (0, 8, 3.0)]
    assert t["slow"][0][3:] == (1000.0, 0.0, 0.0)  # the longest stall within it
    assert t["slow"][1][3:] == (0.0, 250.0, 100.0)
    assert (t["with_stall"], t["with_gc"], t["with_server_gc"], t["with_none"]) == (1, 1, 1, 1)
    assert t["share_with_stall"] == 1 / 10
    assert attribute([([], [])], [], []) == {}


def test_the_stall_probe_sees_a_stop_of_its_process():
    import os
    import signal
    import time

    from lmcache_mp.loadgen.tails import machine_stalls, stall_probe

    with stall_probe() as probe:
        os.kill(probe.pid, signal.SIGSTOP)
        time.sleep(0.1)
        os.kill(probe.pid, signal.SIGCONT)
        time.sleep(0.05)
    assert max(n for _, n in probe.stalls) >= 80_000_000
    m = machine_stalls(probe)
    assert m["over_50us"] >= 1 and m["longest_us"] >= 80_000 and m["seconds"] >= 0.15
    with stall_probe(enabled=False) as off:
        pass
    assert off.stalls == [] and machine_stalls(off) == {}


def test_a_failed_run_says_each_cause_once(capsys):
    """A server gone is one cause however each worker met it; workers stopped at a barrier by
    another's failure are no cause; a bug's traceback is shown."""
    from lmcache_mp.loadgen.runs import failure, print_failures

    print_failures({0: failure("store", "no reply from the server at tcp://x:1: it stopped", server_gone=True),
                    1: failure("lookup", "ServerUnavailable: the Lookup was lost", server_gone=True),
                    2: dict(failure("lookup", "BrokenBarrierError: "), after_another=True),
                    3: dict(failure("verify", "KeyError: 'x'"), traceback="Traceback (most recent call last): ...")}, 4)
    assert capsys.readouterr().err.splitlines() == [
        "lmcache-mp-bench: workers 0, 1 of 4 failed in the store (worker 0) and lookup (worker 1) phases: no reply "
        "from the server at tcp://x:1: it stopped",
        "lmcache-mp-bench: worker 3 of 4 failed in the verify phase: KeyError: 'x'",
        "--- worker 3:", "Traceback (most recent call last): ..."]
