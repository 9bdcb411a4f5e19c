"""Worker processes for the two-GPU server tests: tensor-parallel ranks of one model, each on its
own GPU and seeing only that GPU (as device 0), talking to one server that sees both."""

from __future__ import annotations

import os
import traceback

import numpy as np

N_CHUNKS = 4


def _device_info(expect_uuid: str) -> dict:
    """This process must see exactly the one GPU it was given."""
    import torch

    seen = torch.cuda.device_count()
    if seen != 1:
        raise AssertionError(f"expected to see one GPU, see {seen} "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    torch.cuda.set_device(0)
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    if uuid != expect_uuid:
        raise AssertionError(f"on {uuid}, expected {expect_uuid}")
    return {"uuid": uuid, "nvls": os.environ.get("NCCL_NVLS_ENABLE")}


def _block_tables(seed: int, rank: int):
    """Source, destination and second destination block ids: each rank has its own block table."""
    from gpu_workers import BPC

    rng = np.random.default_rng([seed, rank])
    n = N_CHUNKS * BPC
    return rng.permutation(64)[:n], 64 + rng.permutation(32)[:n], 96 + rng.permutation(32)[:n]


def _store_on_busy_stream(client, handle, kv, hashes, src, fresh):
    """Write this rank's KV on a stream still busy when store() is called (the server must wait
    on our event), then store it."""
    import torch
    from gpu_workers import _write

    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        _write(kv, src, fresh)
    res = client.store(handle, hashes, src, stream=producer).result()
    producer.synchronize()
    return res


def _retrieve_and_compare(client, handle, kv, hashes, dst, dst2, want) -> None:
    """Retrieve with a host wait and with a stream wait; both must equal `want` bit for bit."""
    import torch
    from gpu_workers import _bits, _blocks, _same

    got = client.retrieve(handle, hashes, dst).result()
    if got.loaded != N_CHUNKS or not _same(kv, dst, want):
        raise AssertionError(f"retrieve (host wait): loaded {got.loaded}, bytes equal {_same(kv, dst, want)}")
    s2 = torch.cuda.Stream()
    got = client.retrieve(handle, hashes, dst2, stream=s2, wait="stream").result()
    with torch.cuda.stream(s2):  # ordered after the copy by the stream wait alone
        ok = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(_blocks(kv, dst2), want))
    if got.loaded != N_CHUNKS or not ok:
        raise AssertionError(f"retrieve (stream wait): loaded {got.loaded}, bytes equal {ok}")


def tp_mha_rank(url: str, model: str, rank: int, seed: int, expect_uuid: str, barrier, q):
    """MHA, TP rank `rank` of 2: each rank stores and retrieves its own shard. Rank 0 stores
    first; a lookup then finds nothing (rank 1's shard is missing), and all chunks once rank 1
    has stored too."""
    try:
        import torch
        from gpu_kv import make_cuda_kv
        from gpu_workers import BLOCK, CHUNK, _blocks, _same, _write
        from lmcache_mp import Client, chunk_hashes

        info = _device_info(expect_uuid)
        client = Client(url, timeout=60)
        if client.chunk_size != CHUNK:
            raise AssertionError(f"server chunk size {client.chunk_size}, tests use {CHUNK}")
        kv = make_cuda_kv("mha", torch.bfloat16, layers=4, blocks=128, block_size=BLOCK, seed=seed + rank)
        handle = client.register_kv_cache(kv.tensors, model=model, world_size=2, rank=rank)
        info.update(rank=rank, layout=handle.layout, shared=handle.shared, mode=handle.transfer_mode)
        src, dst, dst2 = _block_tables(seed, rank)
        tokens = np.random.default_rng(seed).integers(0, 50000, N_CHUNKS * CHUNK)  # one prompt, every rank
        hashes = chunk_hashes(tokens, client.chunk_size)
        # this rank's shard: different bytes on every rank
        g = torch.Generator(device="cpu").manual_seed(seed * 10 + rank)
        fresh = [torch.randint(-32768, 32768, b.shape, generator=g, dtype=torch.int16).cuda().view(b.dtype)
                 for b in _blocks(kv, src)]

        if rank == 0:
            res = _store_on_busy_stream(client, handle, kv, hashes, src, fresh)
            if res.stored != N_CHUNKS:
                raise AssertionError(f"rank 0 store: {res}")
        barrier.wait(120)
        info["lookup_after_rank0"] = client.lookup(hashes, model=model, world_size=2)
        barrier.wait(120)
        if rank == 1:
            res = _store_on_busy_stream(client, handle, kv, hashes, src, fresh)
            if res.stored != N_CHUNKS:
                raise AssertionError(f"rank 1 store: {res}")
        barrier.wait(120)
        info["lookup_after_both"] = client.lookup(hashes, model=model, world_size=2)

        _write(kv, src, [torch.zeros_like(f) for f in fresh])  # the source blocks are reused
        if _same(kv, src, fresh):
            raise AssertionError("overwriting the source blocks did not change them")
        _retrieve_and_compare(client, handle, kv, hashes, dst, dst2, fresh)
        barrier.wait(120)
        client.close()
        q.put(("ok", info))
    except BaseException:
        try:
            barrier.abort()
        except Exception:
            pass
        q.put(("fail", traceback.format_exc()))


def tp_mla_rank(url: str, model: str, rank: int, seed: int, shared_seed: int, expect_uuid: str, barrier, q):
    """MLA, TP rank `rank` of 2: only rank 0 stores; the one shared copy serves both ranks, so
    rank 1 (whose own cache never held these bytes) retrieves exactly rank 0's data."""
    try:
        import torch
        from gpu_kv import make_cuda_kv
        from gpu_workers import BLOCK, CHUNK, _blocks, _same
        from lmcache_mp import Client, chunk_hashes

        info = _device_info(expect_uuid)
        client = Client(url, timeout=60)
        if client.chunk_size != CHUNK:
            raise AssertionError(f"server chunk size {client.chunk_size}, tests use {CHUNK}")
        kv = make_cuda_kv("mla", torch.bfloat16, layers=4, blocks=128, block_size=BLOCK, seed=seed + rank)
        handle = client.register_kv_cache(kv.tensors, model=model, world_size=2, rank=rank)
        info.update(rank=rank, layout=handle.layout, shared=handle.shared, mode=handle.transfer_mode)
        src, dst, dst2 = _block_tables(seed, rank)
        tokens = np.random.default_rng(seed).integers(0, 50000, N_CHUNKS * CHUNK)
        hashes = chunk_hashes(tokens, client.chunk_size)
        # The latent KV every rank computes: the same on both ranks, generated from the shared seed
        # on the CPU (bit-identical whatever the GPU).
        g = torch.Generator(device="cpu").manual_seed(shared_seed)
        data = [torch.randint(-32768, 32768, b.shape, generator=g, dtype=torch.int16).cuda().view(b.dtype)
                for b in _blocks(kv, src)]

        if rank == 0:
            res = _store_on_busy_stream(client, handle, kv, hashes, src, data)
            if res.stored != N_CHUNKS:
                raise AssertionError(f"rank 0 store: {res}")
        elif _same(kv, src, data) or _same(kv, dst, data):
            raise AssertionError("rank 1's cache already holds the data: the test would prove nothing")
        barrier.wait(120)
        info["lookup_after_rank0"] = client.lookup(hashes, model=model, world_size=2)
        if rank == 0:
            from gpu_workers import _write

            _write(kv, src, [torch.zeros_like(d) for d in data])
        _retrieve_and_compare(client, handle, kv, hashes, dst, dst2, data)
        barrier.wait(120)
        client.close()
        q.put(("ok", info))
    except BaseException:
        try:
            barrier.abort()
        except Exception:
            pass
        q.put(("fail", traceback.format_exc()))
