"""Worker processes for the GPU server tests: each owns a CUDA KV cache and talks to the server
through the real client, over CUDA IPC and inter-process events."""

from __future__ import annotations

import traceback

import numpy as np

CHUNK = 64
BLOCK = 16
BPC = CHUNK // BLOCK


def _blocks(kv, ids):
    import torch

    idx = torch.as_tensor(ids, device="cuda")
    if kv.spec.kind == "mha":  # [2, NB, ...]; the other layouts put blocks first
        return [t[:, idx].clone() for t in kv.tensors]
    return [t[idx].clone() for t in kv.tensors]


def _bits(t):
    """Compare bit patterns: random bits include NaNs, which never equal themselves."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(kv, ids, want) -> bool:
    import torch

    return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(_blocks(kv, ids), want))


def _write(kv, ids, values):
    import torch

    idx = torch.as_tensor(ids, device="cuda")
    for t, v in zip(kv.tensors, values):
        if kv.spec.kind == "mha":
            t[:, idx] = v
        else:
            t[idx] = v


def roundtrip(url: str, model: str, rank: int, world: int, layout: str, seed: int, q, token_seed=None,
              data_seed=None, barrier=None, transfer="auto", staging_bytes=None):
    """Write KV on a busy stream, store (the copy waits for that stream), overwrite the source,
    retrieve into other blocks (host wait and stream wait), compare. Ranks of one model share
    token_seed (the same prompt); MLA ranks also share data_seed (the same KV bytes). transfer:
    who copies ("engine": this process; "server"); staging_bytes: the engine's ring (1: two
    chunks, less than a request: the copies wait for free slots)."""
    try:
        import torch
        from gpu_kv import make_cuda_kv

        from lmcache_mp import Client, chunk_hashes

        torch.cuda.set_device(0)
        client = Client(url, timeout=60)
        kv = make_cuda_kv(layout, torch.bfloat16, layers=4, blocks=128, block_size=BLOCK, seed=seed)
        handle = client.register_kv_cache(kv.tensors, model=model, world_size=world, rank=rank, transfer=transfer,
                                          staging_bytes=staging_bytes)
        if transfer != "auto" and (handle.transfer_mode == "engine") != (transfer == "engine"):
            raise AssertionError(f"asked for {transfer} copies, got transfer mode {handle.transfer_mode}")
        rng = np.random.default_rng(seed)
        n = 4
        src = rng.permutation(64)[: n * BPC]
        dst = 64 + rng.permutation(32)[: n * BPC]
        dst2 = 96 + rng.permutation(32)[: n * BPC]
        tokens = np.random.default_rng(seed if token_seed is None else token_seed).integers(0, 50000, n * CHUNK)
        hashes = chunk_hashes(tokens, client.chunk_size)
        # the KV the "model" produces, on a stream still busy when store() is called
        g = torch.Generator(device="cuda").manual_seed(seed if data_seed is None else data_seed)
        fresh = [torch.randint(-30000, 30000, b.shape, device="cuda", generator=g, dtype=torch.int16).view(b.dtype)
                 for b in _blocks(kv, src)]
        torch.cuda.synchronize()
        producer = torch.cuda.Stream()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(100_000_000)
            _write(kv, src, fresh)
        stored = client.store(handle, hashes, src, stream=producer).result()
        if stored.chunks != n:
            raise AssertionError(f"store: {stored}")
        producer.synchronize()
        if barrier is not None:
            barrier.wait()  # every rank has stored
        hits = client.lookup(hashes, model=model, world_size=world)
        if hits != n:
            raise AssertionError(f"lookup found {hits} of {n} chunks")
        _write(kv, src, [torch.zeros_like(f) for f in fresh])  # the blocks are free again
        got = client.retrieve(handle, hashes, dst).result()
        if got.loaded != n or not _same(kv, dst, fresh):
            raise AssertionError(f"retrieve (host wait): loaded {got.loaded}, bytes equal {_same(kv, dst, fresh)}")
        s2 = torch.cuda.Stream()
        got = client.retrieve(handle, hashes, dst2, stream=s2, wait="stream").result()
        with torch.cuda.stream(s2):  # ordered after the copy by the stream wait alone
            ok = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(_blocks(kv, dst2), fresh))
        if got.loaded != n or not ok:
            raise AssertionError(f"retrieve (stream wait): loaded {got.loaded}, bytes equal {ok}")
        if barrier is not None:
            barrier.wait()
        info = {"rank": rank, "mode": handle.transfer_mode, "shared": handle.shared, "layout": handle.layout}
        client.close()
        q.put(("ok", info))
    except BaseException:
        q.put(("fail", traceback.format_exc()))


def store_only(url: str, model: str, rank: int, world: int, seed: int, q, go=None):
    """Rank `rank` stores its shard of chunks; used to check that lookup waits for every rank."""
    try:
        import torch
        from gpu_kv import make_cuda_kv

        from lmcache_mp import Client, chunk_hashes

        client = Client(url, timeout=60)
        kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=64, block_size=BLOCK, seed=seed + rank)
        handle = client.register_kv_cache(kv.tensors, model=model, world_size=world, rank=rank)
        tokens = np.random.default_rng(seed).integers(0, 50000, 3 * CHUNK)
        if go is not None:
            go.wait()
        res = client.store(handle, chunk_hashes(tokens, client.chunk_size), np.arange(3 * BPC)).result()
        q.put(("ok", res.chunks))
        client.close()
    except BaseException:
        q.put(("fail", traceback.format_exc()))


def persisted(url: str, phase: str, seed: int, q):
    """phase "store": store 4 chunks of KV made from seed; "retrieve" (after a server restart):
    retrieve them into fresh blocks and compare with the same KV made again."""
    try:
        import torch
        from gpu_kv import make_cuda_kv

        from lmcache_mp import Client, chunk_hashes

        torch.cuda.set_device(0)
        client = Client(url, timeout=60)
        kv = make_cuda_kv("mha", torch.bfloat16, layers=4, blocks=128, block_size=BLOCK, seed=seed)
        handle = client.register_kv_cache(kv.tensors, model="persist", world_size=1, rank=0)
        n = 4
        hashes = chunk_hashes(np.random.default_rng(seed).integers(0, 50000, n * CHUNK), client.chunk_size)
        src, dst = np.arange(n * BPC), 64 + np.arange(n * BPC)
        g = torch.Generator(device="cuda").manual_seed(seed)
        want = [torch.randint(-30000, 30000, b.shape, device="cuda", generator=g, dtype=torch.int16).view(b.dtype)
                for b in _blocks(kv, src)]
        if phase == "store":
            _write(kv, src, want)
            torch.cuda.synchronize()
            got = client.store(handle, hashes, src).result().chunks
        else:
            got = client.retrieve(handle, hashes, dst).result().loaded
            if not _same(kv, dst, want):
                raise AssertionError("the re-attached chunks differ from what was stored")
        client.close()
        q.put(("ok", got))
    except BaseException:
        q.put(("fail", traceback.format_exc()))


def store_and_die(url: str, q):
    """Registers for its own copies, queues a store behind a long kernel (the copy has not run
    when it reports), and waits to be killed."""
    try:
        import time

        import torch
        from gpu_kv import make_cuda_kv

        from lmcache_mp import Client, chunk_hashes

        client = Client(url, timeout=60)
        kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=64, block_size=BLOCK, seed=3)
        handle = client.register_kv_cache(kv.tensors, model="killed", transfer="engine")
        client.pin_l1()  # before the long kernel: page-locking waits for other CUDA work of the process
        busy = torch.cuda.Stream()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(20_000_000_000)  # ~10 s of GPU time before the KV is there
        tokens = np.random.default_rng(3).integers(0, 50000, 4 * CHUNK)
        t0 = time.monotonic()
        fut = client.store(handle, chunk_hashes(tokens, client.chunk_size), np.arange(4 * BPC), stream=busy)
        took = time.monotonic() - t0
        if fut.done():  # the copy must still be waiting for the busy stream when we are killed
            q.put(("fail", f"the store ended before the kill ({took:.2f} s in store()): "
                           f"{fut.exception() or fut.result()}"))
            return
        q.put(("ok", f"{took:.3f} s in store()"))
        time.sleep(120)
    except BaseException:
        q.put(("fail", traceback.format_exc()))


def hold_a_large_cache(url: str, q, gib: int, storing: bool):
    """Registers one KV cache of `gib` GiB (vLLM's way: one allocation, per-layer views), then idles
    or keeps stores in flight until it is killed."""
    try:
        import time

        import torch

        from lmcache_mp import Client, chunk_hashes

        client = Client(url, timeout=60)
        layers, heads, head_size = 8, 8, 128
        block_bytes = 2 * BLOCK * heads * head_size * 2  # K and V of one layer's block, bf16
        blocks = (gib << 30) // (layers * block_bytes)
        buf = torch.zeros((layers, 2, blocks, BLOCK, heads, head_size), dtype=torch.bfloat16, device="cuda")
        kv = [buf[i] for i in range(layers)]
        handle = client.register_kv_cache(kv, model="held")
        torch.cuda.synchronize()
        q.put(("ok", f"{buf.numel() * 2 / 2**30:.1f} GiB registered"))
        i = 0
        while True:
            if storing:
                hashes = chunk_hashes(np.arange(i * 4 * CHUNK, (i + 1) * 4 * CHUNK), client.chunk_size)
                client.store(handle, hashes, np.arange(4 * BPC) + (i % 8) * 4 * BPC)
                i += 1
                time.sleep(0.001)
            else:
                time.sleep(1)
    except BaseException:
        q.put(("fail", traceback.format_exc()))
