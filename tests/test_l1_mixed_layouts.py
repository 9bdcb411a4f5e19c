"""One server shared by two layouts (two models, or one model stored by two engines' settings):
the second layout's working set stays whole while the first layout's older chunks make room.

Runs lmcache-mp-bench against a CPU-device server in this process: 32 MiB Llama-3-8B chunks fill
a 1 GiB L1, then a working set of 432 MiB of 2.25 MiB MLA chunks is stored, looked up and read
back byte for byte."""

from __future__ import annotations

import json

import pytest

import lmcache_mp
from lmcache_mp.loadgen import cli as loadgen
from lmcache_mp.loadgen.worker import WARM_UP
from lmcache_mp.server.ops.metrics import StatusCollector

LLAMA, MLA8 = 32 << 20, 8 * 256 * 576 * 2  # object bytes at the default 256-token chunk


@pytest.fixture
def server():
    srv = lmcache_mp.Server(lmcache_mp.ServerConfig(url="tcp://127.0.0.1:0", l1_size="1GiB", device="cpu"))
    srv.start()
    yield srv
    srv.stop()


def _sizes(srv) -> dict:
    return {s["object_bytes"]: s for s in srv.engine.status()["l1"]["sizes"]}


def test_a_second_layout_keeps_its_working_set_and_the_first_layouts_old_chunks_make_room(server, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    # 40 + WARM_UP chunks of 32 MiB into 1 GiB: the first run itself overflows (its own misses are
    # expected).
    loadgen.main(["--url", server.url, "--chunks", "4", "--requests", "10", "--lookups", "20",
                  "--json", str(first)])
    assert _sizes(server)[LLAMA]["objects"] == 32  # L1 is full of the first layout's chunks
    rc = loadgen.main(["--url", server.url, "--layout", "mla", "--layers", "8", "--chunks", "16",
                       "--requests", "12", "--lookups", "24", "--json", str(second)])
    row = json.loads(second.read_text())["rows"][0]
    assert row["missing"] == 0 and row["mismatches"] == 0 and row["lookups_short"] == 0
    assert row["loaded_chunks"] == row["stored_chunks"] == 16 * 12
    assert rc == 0
    sizes = _sizes(server)
    assert sizes[MLA8]["evicted"] == 0, "a chunk of the working set was evicted"
    assert sizes[MLA8]["objects"] == 16 * 12 + WARM_UP  # + the warm-up chunks
    evicted_llama = sizes[LLAMA]["evicted"]
    assert evicted_llama > 9 and sizes[LLAMA]["objects"] == 40 + WARM_UP - evicted_llama
    # Memory moved to the new size a slab at a time, and what is idle stays within the bound.
    slab = server.engine.arena.slab_bytes
    for s in sizes.values():
        assert s["bytes_free"] < slab and s["bytes_fragmented"] < s["slabs"] * s["slot_bytes"]

    # The same figures in the metrics, per object size.
    metrics = {(smp.name, smp.labels.get("object_bytes")): smp.value
               for m in StatusCollector(server.engine).collect() for smp in m.samples}
    assert metrics["lmcache_mp_l1_size_evicted_total", str(MLA8)] == 0
    assert metrics["lmcache_mp_l1_size_evicted_total", str(LLAMA)] == evicted_llama
    assert metrics["lmcache_mp_l1_size_objects", str(MLA8)] == 16 * 12 + WARM_UP
    for metric, field in (("used_bytes", "bytes_used"), ("free_bytes", "bytes_free"),
                          ("fragmented_bytes", "bytes_fragmented"), ("slabs", "slabs")):
        assert metrics[f"lmcache_mp_l1_size_{metric}", str(LLAMA)] == sizes[LLAMA][field]
    assert metrics["lmcache_mp_moved_total", None] > 0
