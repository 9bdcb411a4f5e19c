"""bench/bench_sglang_gpu.py on the CPU device: SGLang-shaped pools through the linker's code
(one registration, engine copies, layer groups) and through HiCache's path, server in its own
process, every load checked bit for bit inside the benchmark; no sglang needed."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_sglang_gpu.py"


def test_cpu_run_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--quick", "--layers", "3", "--heads", "2",
                           "--pages", "1,4", "--layer-groups", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bit-exact: ALL PASS" in proc.stdout
    r = json.loads(out.read_text())
    assert r["failures"] == [] and r["runs_per_page"] == 6
    assert [row["pages"] for row in r["results"]] == [1, 4]
    for row in r["results"]:
        for arm in ("linker", "linker-engine", "linker-groups", "hicache"):
            for op in ("offload", "load"):
                assert row[f"{arm}_{op}_gbs"] > 0 and row[f"{arm}_{op}_x_memcpy"] > 0
        assert 0 < row["linker-groups_first_layers_ms"] <= row["linker-groups_load_ms"]
