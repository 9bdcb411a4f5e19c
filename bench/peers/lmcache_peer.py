"""Benchmark arm (e): LMCache 0.5.3's own multiprocess-server transfer path.

This module drives the code that LMCache's MP cache server (``lmcache.v1.multiprocess``) runs
for a GPU store or retrieve, with LMCache's own classes, in this process. Nothing of LMCache
is copied here: the package is imported at run time (from the wheels in ``.peerwheels/``, see
``README.md`` beside this file) and ``available()`` says why the arm is skipped when it cannot
be imported or its compiled ops are missing.

How it maps to the server (lmcache 0.5.3)
-----------------------------------------
REGISTER_KV_CACHE, ``LMCacheDrivenTransferModule.register_kv_cache``:
  ``lmcache.v1.platform.cache_context.create_cache_context(wrappers, chunk_size, layout_hints,
  engine_group_infos, EngineType.VLLM)`` builds a ``GPUCacheContext``
  (``lmcache.v1.platform.cuda.cache_context``): detects the KV format (vLLM flash-attention
  ``NL_X_TWO_NB_BS_NH_HS``, or MLA ``NL_X_NB_BS_HS``), the per-layer pointer table, a device
  staging buffer of ``max_batch_size`` (4) chunk slots and its own CUDA stream. The server gets
  the tensors from CUDA-IPC wrappers through ``wrapper.to_tensor()``; here the KV caches live in
  this process, so a wrapper hands back the same zero-copy view (CUDA IPC forbids opening a
  handle in the process that exported it). ``get_layout_desc`` gives the host object layout.
L1 memory, ``StorageManager`` -> ``L1Manager`` -> ``L1MemoryManager``:
  ``L1MemoryManager(L1MemoryManagerConfig(size, use_lazy=True, ...))`` makes the server's
  default allocator, ``LazyMemoryAllocator`` (pageable buffer, ``cudaHostRegister``-ed; the
  whole pool is pinned up front here, as the server does for its first 20 GiB), and
  ``L1MemoryManager.allocate(layout_desc, n)`` returns its ``TensorMemoryObj`` chunk objects:
  MHA ``[2, L, 256, H*D]``, MLA ``[1, L, 256, D]``, in the KV dtype.
STORE, ``LMCacheDrivenTransferModule.store``, inside ``torch_dev.device(ctx.device)`` and
``torch_dev.stream(ctx.stream)``, after the stream waits for the producer (here: the caller's
current stream):
  ``downsample_and_stage_block_ids(ctx, [block_ids])`` then ``transfer_kv_per_object_group(ctx,
  block_ids_gpu, objs, object_group_id=0, batch_size=1, skip_first_n_tokens=0,
  direction=TransferDirection.D2H)``; with the compiled ops this goes to
  ``lmcache.c_ops.execute_object_group_transfer`` (one gather kernel into a staging slot and one
  DMA of the packed chunk into the pinned object, per chunk, on ``ctx.stream``).
RETRIEVE, ``LMCacheDrivenTransferModule.retrieve``: the same two calls with
  ``batch_size=ctx.max_batch_size`` and ``TransferDirection.H2D`` (DMA up to 4 chunks into the
  staging slots, then one scatter kernel per batch).
Left out, as they move no KV bytes: ZMQ and the IPC events, token hashing and the L1 index
(``reserve_write``/``finish_write``, ``read_prefetched_results``), observability events.

The compiled ops: ``import lmcache`` binds ``lmcache.c_ops`` to a ``CudaDeviceOps`` whose
methods are replaced by the compiled functions; if the extension fails to load, it only logs a
warning and every op silently runs a slow torch fallback (and ``execute_object_group_transfer``
is absent). ``available()`` therefore requires that the ops used here are the compiled
builtins and that ``lmcache_driven_transfer._HAS_NATIVE_OBJECT_GROUP_TRANSFER`` is true;
``check()`` also counts the calls that reach the compiled executor.

Self-test on the GPU machine (wheels from ``.peerwheels/``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer \\
        .peerwheels/*.whl .devwheels/*.whl
    PYTHONPATH=/tmp/peer:$PYTHONPATH python3 bench/peers/lmcache_peer.py --json $OUT/peer.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

LMCACHE_VERSION = "0.5.3"
# The compiled functions this arm's path reaches (``lmcache_memcpy_async`` and
# ``multi_layer_block_kv_transfer`` are the per-call variants of the same path).
_NATIVE_OPS = (
    "execute_object_group_transfer",
    "multi_layer_block_kv_transfer",
    "lmcache_memcpy_async",
)
_PIN_CHUNK = 64 << 20
_SELFTEST_DEVICE = "cuda"  # a CPU dry run of the glue swaps it

_lm: types.SimpleNamespace | None = None


class PeerUnavailable(RuntimeError):
    """LMCache or its compiled ops cannot be used here."""


def _stub_numba_if_missing() -> bool:
    """lmcache imports ``numba.njit`` at module import (for torch fallbacks and token hashing,
    neither on this path). Where numba cannot be imported, a no-op ``njit`` lets the import go on."""
    try:
        import numba  # noqa: F401

        return False
    except Exception:  # ImportError, or a numba that refuses this numpy
        stub = types.ModuleType("numba")

        def njit(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return lambda fn: fn

        stub.njit = njit  # type: ignore[attr-defined]
        sys.modules["numba"] = stub
        return True


def _load(require_native: bool = True) -> types.SimpleNamespace:
    """Import the LMCache pieces once. ``require_native=False`` is for CPU dry runs of the glue
    (the compiled-op checks are skipped); the benchmark never uses it."""
    global _lm
    if _lm is not None:
        return _lm
    numba_stubbed = _stub_numba_if_missing()
    import lmcache
    from lmcache import torch_dev, torch_device_type

    version = str(getattr(lmcache, "__version__", "unknown"))
    ops = None
    if require_native:
        if version.split("+")[0] != LMCACHE_VERSION:
            raise PeerUnavailable(f"lmcache {version} found, this arm is written for {LMCACHE_VERSION}")
        if torch_device_type != "cuda":
            raise PeerUnavailable(f"lmcache detected device {torch_device_type!r}, not 'cuda'")
        from lmcache.v1.platform import resolve_device_ops

        ops = resolve_device_ops("cuda")
        bound = vars(ops)
        not_native = [n for n in _NATIVE_OPS if not isinstance(bound.get(n), types.BuiltinFunctionType)]
        if type(ops).__name__ != "CudaDeviceOps" or not_native:
            raise PeerUnavailable(
                f"compiled lmcache.c_ops not bound ({type(ops).__name__}; torch fallback for "
                f"{', '.join(not_native) or 'all'}): the extension failed to load, see LMCache's warning"
            )
    import lmcache.c_ops as lmc_ops  # the shim over the resolved DeviceOps
    from lmcache.utils import EngineType
    from lmcache.v1.distributed.config import L1MemoryManagerConfig
    from lmcache.v1.distributed.error import L1Error
    from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
    from lmcache.v1.gpu_connector.kv_format.contiguity import attempt_permute_to_contiguous_view
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt
    from lmcache.v1.platform.cache_context import create_cache_context
    from lmcache.v1.platform.cuda.cache_context import GPUCacheContext

    if require_native:
        if not ldt._HAS_NATIVE_OBJECT_GROUP_TRANSFER:
            raise PeerUnavailable("lmcache.c_ops has no execute_object_group_transfer")
        import cupy  # noqa: F401  (GPUCacheContext wraps its stream in a cupy ExternalStream)

    _lm = types.SimpleNamespace(
        lmcache=lmcache, version=version, torch_dev=torch_dev, ops=ops, lmc_ops=lmc_ops, ldt=ldt,
        EngineType=EngineType, EngineGroupInfo=EngineGroupInfo, L1Error=L1Error,
        L1MemoryManager=L1MemoryManager, L1MemoryManagerConfig=L1MemoryManagerConfig,
        attempt_permute_to_contiguous_view=attempt_permute_to_contiguous_view,
        create_cache_context=create_cache_context, GPUCacheContext=GPUCacheContext,
        numba_stubbed=numba_stubbed,
    )
    return _lm


def available() -> tuple[bool, str]:
    """(True, description) when LMCache 0.5.3 and its compiled CUDA ops are usable here;
    otherwise (False, reason), and the benchmark skips this arm."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        lm = _load()
    except PeerUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # a missing wheel, a symbol that does not resolve, ...
        return False, f"lmcache is not importable: {type(exc).__name__}: {exc}"
    note = ", numba stubbed" if lm.numba_stubbed else ""
    return True, (
        f"lmcache {lm.version}, compiled c_ops bound ({', '.join(_NATIVE_OPS)} are builtins){note}"
    )


class _InProcessKV:
    """Stands in for LMCache's ``CudaIPCWrapper``: the server only calls ``to_tensor()``, which
    rebuilds the stride-sorted view taken at wrap time; here that view is the tensor itself."""

    def __init__(self, tensor: Any, permute: Any) -> None:
        self._tensor = permute(tensor)

    def to_tensor(self) -> Any:
        return self._tensor


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class LMCachePeer:
    """LMCache's GPU cache context, L1 allocator and transfer functions over ``kv_caches``.

    ``kv_caches``: one CUDA tensor per layer, MHA ``[2, num_blocks, block_size, H, D]`` (vLLM
    flash-attention, NHD) or MLA ``[num_blocks, block_size, D]``. ``max_chunks`` sizes the pinned
    host pool (objects alive at once); ``host_pool_bytes`` overrides it.
    """

    def __init__(
        self,
        kv_caches: Sequence[Any],
        block_size: int,
        chunk_size: int = 256,
        layout: str = "mha",
        max_chunks: int = 64,
        host_pool_bytes: int | None = None,
    ) -> None:
        lm = _load()
        self._lm = lm
        if layout not in ("mha", "mla"):
            raise ValueError(f"layout must be 'mha' or 'mla', not {layout!r}")
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        if chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
        rank, block_axis = (5, 1) if layout == "mha" else (3, 0)
        for t in kv_caches:
            if t.dim() != rank or t.shape[block_axis + 1] != block_size or (layout == "mha" and t.shape[0] != 2):
                raise ValueError(f"{layout} layer of shape {tuple(t.shape)} does not fit block_size {block_size}")
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.num_blocks = int(kv_caches[0].shape[block_axis])
        num_layers = len(kv_caches)

        dev = lm.torch_dev
        if hasattr(dev, "init"):
            dev.init()  # the server calls torch_dev.init() before serving
        wrappers = [_InProcessKV(t, lm.attempt_permute_to_contiguous_view) for t in kv_caches]
        groups = [lm.EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(num_layers)),
                                     tokens_per_block=block_size)]
        with dev.device(kv_caches[0].device):
            ctx = lm.create_cache_context(
                wrappers, chunk_size,
                layout_hints={"kv_layout": "NHD"} if layout == "mha" else {},
                engine_group_infos=groups, engine_type=lm.EngineType.VLLM,
                separate_object_groups=False, full_sw_kv=False,
            )
        if not isinstance(ctx, lm.GPUCacheContext):
            raise PeerUnavailable(f"LMCache built a {type(ctx).__name__}, not a GPUCacheContext")
        self._ctx = ctx
        manager = ctx.kv_layer_groups_manager
        if manager.num_object_groups != 1 or manager.num_kernel_groups != 1:
            raise RuntimeError(
                f"expected one object and one kernel group, got {manager.num_object_groups} "
                f"and {manager.num_kernel_groups}"
            )
        fmt = ctx.get_engine_kv_format(0)
        want = "NL_X_TWO_NB_BS_NH_HS" if layout == "mha" else "NL_X_NB_BS_HS"
        if fmt != getattr(lm.lmc_ops.EngineKVFormat, want):
            raise RuntimeError(f"LMCache detected KV format {fmt}, expected {want}")
        self.kv_format = want

        self._layout_desc = lm.ldt.get_layout_desc(ctx, chunk_size, object_group_id=0)
        (shape,), (dtype,) = self._layout_desc.shapes, self._layout_desc.dtypes
        self.object_shape = tuple(int(s) for s in shape)
        self.object_dtype = dtype
        self.object_nbytes = int(shape.numel()) * dtype.itemsize
        width = kv_caches[0].shape[3] * kv_caches[0].shape[4] if layout == "mha" else kv_caches[0].shape[2]
        want_shape = (2 if layout == "mha" else 1, num_layers, chunk_size, int(width))
        if self.object_shape != want_shape:
            raise RuntimeError(f"LMCache object shape {self.object_shape}, expected {want_shape}")

        pool = host_pool_bytes or _round_up(max_chunks * _round_up(self.object_nbytes, 4096) + _PIN_CHUNK, _PIN_CHUNK)
        config = lm.L1MemoryManagerConfig(
            size_in_bytes=pool, use_lazy=True, init_size_in_bytes=pool, align_bytes=4096, shm_name=""
        )
        if not config.use_lazy:
            raise PeerUnavailable("LMCache reports that host memory cannot be pinned here")
        self._l1 = lm.L1MemoryManager(config)
        allocator = self._l1._allocator
        pinned = sum(size for _, size in getattr(allocator, "_pin_record", ()))
        if pinned < pool:
            self._l1.close()
            raise RuntimeError(f"cudaHostRegister pinned {pinned} of {pool} bytes of the L1 pool")
        self.host_pool_bytes = pool
        dev.synchronize()  # the context's pointer table was copied on the default stream

    # -- transfers -----------------------------------------------------------------------------

    @property
    def stream(self) -> Any:
        """The cache context's stream: every copy of this arm runs on it."""
        return self._ctx.stream

    @property
    def max_batch_size(self) -> int:
        return self._ctx.max_batch_size

    def _flat_block_ids(self, block_ids_per_chunk: Sequence[Sequence[int]]) -> list[int]:
        flat: list[int] = []
        for ids in block_ids_per_chunk:
            if len(ids) != self.blocks_per_chunk:
                raise ValueError(f"a chunk needs {self.blocks_per_chunk} block ids, got {len(ids)}")
            flat.extend(int(b) for b in ids)
        if flat and not 0 <= min(flat) <= max(flat) < self.num_blocks:
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return flat

    def _transfer(self, flat: list[int], objs: Sequence[Any], direction: Any, batch_size: int) -> None:
        lm, ctx = self._lm, self._ctx
        producer = lm.torch_dev.current_stream(ctx.device)
        with lm.torch_dev.device(ctx.device), lm.torch_dev.stream(ctx.stream):
            ctx.stream.wait_stream(producer)  # the server waits on the worker's IPC event here
            block_ids_gpu = lm.ldt.downsample_and_stage_block_ids(ctx, [flat])
            lm.ldt.transfer_kv_per_object_group(
                ctx, block_ids_gpu, list(objs), object_group_id=0, batch_size=batch_size,
                skip_first_n_tokens=0, direction=direction,
            )

    def store(self, block_ids_per_chunk: Sequence[Sequence[int]]) -> list[Any]:
        """Copy the chunks' GPU blocks into new L1 objects (one per chunk), as the server's STORE
        does; returns the objects. The copy is queued on ``stream``: ``synchronize()`` or
        ``wait()`` before reading them or reusing the blocks."""
        flat = self._flat_block_ids(block_ids_per_chunk)
        err, objs = self._l1.allocate(self._layout_desc, len(block_ids_per_chunk))
        if err != self._lm.L1Error.SUCCESS:
            raise MemoryError(f"L1 pool of {self.host_pool_bytes} bytes is full ({err})")
        try:
            self._transfer(flat, objs, self._lm.lmc_ops.TransferDirection.D2H, batch_size=1)
        except BaseException:
            self.synchronize()
            self._l1.free(objs)
            raise
        return objs

    def retrieve(self, objs: Sequence[Any], block_ids_per_chunk: Sequence[Sequence[int]]) -> None:
        """Copy the objects back into these GPU blocks, as the server's RETRIEVE does."""
        flat = self._flat_block_ids(block_ids_per_chunk)
        if len(objs) != len(block_ids_per_chunk):
            raise ValueError(f"{len(objs)} objects for {len(block_ids_per_chunk)} chunks")
        self._transfer(flat, objs, self._lm.lmc_ops.TransferDirection.H2D, batch_size=self._ctx.max_batch_size)

    def free(self, objs: Sequence[Any]) -> None:
        """Give the objects back to the L1 allocator (after their copies have finished)."""
        if objs:
            self._l1.free(list(objs))

    def synchronize(self) -> None:
        self._ctx.stream.synchronize()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the queued copies."""
        (stream or self._lm.torch_dev.current_stream(self._ctx.device)).wait_stream(self._ctx.stream)

    def object_tensor(self, obj: Any) -> Any:
        """The host bytes of one object as a CPU tensor of ``object_shape``."""
        return obj.tensor

    def close(self) -> None:
        self.synchronize()
        self._l1.close()
        self._ctx.close()

    # -- verification ----------------------------------------------------------------------------

    def reference_object(self, block_ids: Sequence[int]) -> Any:
        """The object that one chunk's blocks should become, built with torch indexing
        (``[2, L, T, H*D]`` or ``[1, L, T, D]``), on the KV device."""
        import torch

        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.kv_caches[0].device)
        T = self.chunk_size
        if self.layout == "mha":
            return torch.stack([t[:, idx].reshape(2, T, -1) for t in self.kv_caches], dim=1)
        return torch.stack([t[idx].reshape(T, -1) for t in self.kv_caches], dim=0).unsqueeze(0)

    @contextlib.contextmanager
    def count_native_calls(self) -> Iterator[dict[str, int]]:
        """Count the calls that reach the compiled ops during the block (for checks only)."""
        counts = {name: 0 for name in _NATIVE_OPS}
        ops = self._lm.ops
        if ops is None:
            yield counts
            return
        originals = {name: vars(ops)[name] for name in _NATIVE_OPS}

        def counting(name: str, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return fn(*args, **kwargs)

            return call

        for name, fn in originals.items():
            setattr(ops, name, counting(name, fn))
        try:
            yield counts
        finally:
            for name, fn in originals.items():
                setattr(ops, name, fn)

    def check(self, num_chunks: int = 6, seed: int = 0) -> dict[str, Any]:
        """Store random KV from some blocks, compare the host objects with ``reference_object``,
        retrieve them into other blocks and compare bit for bit; blocks outside the transfer must
        stay untouched. Overwrites the KV caches. Returns named booleans and call counts."""
        import torch

        need = 2 * num_chunks * self.blocks_per_chunk
        if need > self.num_blocks:
            raise ValueError(f"check({num_chunks}) needs {need} blocks, the cache has {self.num_blocks}")
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        src, dst, rest = perm[: need // 2], perm[need // 2 : need], perm[need:][:64]
        bpc = self.blocks_per_chunk
        src_chunks = [src[i : i + bpc] for i in range(0, len(src), bpc)]
        dst_chunks = [dst[i : i + bpc] for i in range(0, len(dst), bpc)]
        fill_random_bits(self.kv_caches, seed)
        axis = 1 if self.layout == "mha" else 0

        def blocks(ids: list[int]) -> list[Any]:
            idx = torch.as_tensor(ids, dtype=torch.long, device=self.kv_caches[0].device)
            return [t.index_select(axis, idx) for t in self.kv_caches]

        untouched_before = blocks(rest)
        result: dict[str, Any] = {}
        with self.count_native_calls() as calls:
            objs = self.store(src_chunks)
            self.synchronize()
            result["object_format"] = all(
                bits_equal(self.object_tensor(o), self.reference_object(ids).cpu())
                for o, ids in zip(objs, src_chunks, strict=True)
            )
            self.retrieve(objs, dst_chunks)
            self.synchronize()
        result["roundtrip"] = all(bits_equal(a, b) for a, b in zip(blocks(dst), blocks(src), strict=True))
        result["untouched"] = all(
            bits_equal(a, b) for a, b in zip(blocks(rest), untouched_before, strict=True)
        )
        result["native_calls"] = dict(calls)
        result["native_used"] = self._lm.ops is None or calls["execute_object_group_transfer"] > 0
        self.free(objs)
        return result


# -- helpers shared by check() and the self-test -----------------------------------------------


def fill_random_bits(tensors: Sequence[Any], seed: int) -> None:
    """Random bytes; for 2-byte dtypes, bit 14 is cleared so no value is Inf or NaN (a copy
    that went through float arithmetic would then still be judged on its bytes)."""
    import torch

    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        if t.element_size() == 2:
            v = t.view(torch.int16)
            v.random_(-(1 << 15), 1 << 15, generator=gen)
            v.bitwise_and_(~0x4000)
        else:
            t.view(torch.uint8).random_(0, 256, generator=gen)


def bits_equal(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _median_ms(fn: Any, stream: Any, iters: int, warmup: int, before: Any = None) -> tuple[float, float]:
    """Median (event ms, wall ms) of ``fn()`` whose work is queued on ``stream``; ``before()``
    runs untimed ahead of each call. Events on the idle stream also count the host's enqueue."""
    import torch

    ev, wall = [], []
    for i in range(warmup + iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            wall.append((time.perf_counter() - t0) * 1e3)
            ev.append(start.elapsed_time(end))
    return statistics.median(ev), statistics.median(wall)


def _bench_one(peer: LMCachePeer, src: list[list[int]], dst: list[list[int]], iters: int,
               warmup: int) -> dict[str, Any]:
    held: list[Any] = []

    def release() -> None:
        peer.free(held)
        held.clear()

    store_ms, store_wall = _median_ms(lambda: held.extend(peer.store(src)), peer.stream, iters, warmup,
                                      before=release)
    retrieve_ms, retrieve_wall = _median_ms(lambda: peer.retrieve(held, dst), peer.stream, iters, warmup)
    peer.synchronize()
    release()
    nbytes = len(src) * peer.object_nbytes
    return {
        "chunks": len(src), "bytes": nbytes,
        "store_ms": store_ms, "store_wall_ms": store_wall, "store_GBps": nbytes / store_ms / 1e6,
        "retrieve_ms": retrieve_ms, "retrieve_wall_ms": retrieve_wall,
        "retrieve_GBps": nbytes / retrieve_ms / 1e6,
    }


def bench(peer: LMCachePeer, chunk_counts: Sequence[int], iters: int = 5, warmup: int = 2,
          seed: int = 1) -> list[dict[str, Any]]:
    """Store then retrieve ``n`` chunks (random distinct blocks) for each ``n``; bandwidth counts
    the object bytes moved one way."""
    import torch

    bpc = peer.blocks_per_chunk
    perm = torch.randperm(peer.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    rows = []
    for n in chunk_counts:
        if 2 * n * bpc > peer.num_blocks:
            raise ValueError(f"{n} chunks need {2 * n * bpc} blocks, the cache has {peer.num_blocks}")
        src = [perm[i * bpc : (i + 1) * bpc] for i in range(n)]
        dst = [perm[(n + i) * bpc : (n + i + 1) * bpc] for i in range(n)]
        rows.append(_bench_one(peer, src, dst, iters, warmup))
    return rows


def memcpy_ceiling(nbytes: int, iters: int = 5, warmup: int = 2) -> dict[str, float]:
    """Contiguous pinned-host <-> device copy of ``nbytes`` on a side stream (GB/s each way)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out = {}
    for name, dst, src in (("d2h_GBps", host, gpu), ("h2d_GBps", gpu, host)):
        def copy(dst: Any = dst, src: Any = src) -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        ms, _ = _median_ms(copy, stream, iters, warmup)
        out[name] = nbytes / ms / 1e6
    del host, gpu
    return out


# -- self-test ----------------------------------------------------------------------------------


def _run_layout(name: str, layout: str, shape: tuple[int, ...], layers: int, block_size: int,
                args: argparse.Namespace, report: dict[str, Any]) -> bool:
    import torch

    print(f"--- {name}: {layers} layers x {shape} bf16, block {block_size}, chunk {args.chunk_size}", flush=True)
    kv = [torch.empty(shape, dtype=torch.bfloat16, device=_SELFTEST_DEVICE) for _ in range(layers)]
    t0 = time.perf_counter()
    peer = LMCachePeer(kv, block_size, args.chunk_size, layout, max_chunks=max(args.chunks + args.check_chunks))
    print(f"    context + {peer.host_pool_bytes >> 20} MiB pinned L1 pool in {time.perf_counter() - t0:.1f} s; "
          f"format {peer.kv_format}, object {peer.object_shape} ({peer.object_nbytes >> 20} MiB)")
    ok = True
    entry: dict[str, Any] = {"object_shape": peer.object_shape, "object_bytes": peer.object_nbytes,
                             "kv_format": peer.kv_format, "checks": {}}
    for n in args.check_chunks:
        res = peer.check(num_chunks=n, seed=n)
        entry["checks"][n] = res
        for key in ("object_format", "roundtrip", "untouched", "native_used"):
            good = bool(res[key])
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} {name} check({n} chunks) {key}"
                  + (f" {res['native_calls']}" if key == "native_used" else ""))
    rows = bench(peer, args.chunks, iters=args.iters, warmup=args.warmup)
    entry["bench"] = rows
    print(f"    {'chunks':>6} {'MiB':>7} {'store ms':>9} {'GB/s':>7} {'wall ms':>8} "
          f"{'retr ms':>9} {'GB/s':>7} {'wall ms':>8}")
    for r in rows:
        print(f"    {r['chunks']:>6} {r['bytes'] >> 20:>7} {r['store_ms']:>9.3f} {r['store_GBps']:>7.1f} "
              f"{r['store_wall_ms']:>8.3f} {r['retrieve_ms']:>9.3f} {r['retrieve_GBps']:>7.1f} "
              f"{r['retrieve_wall_ms']:>8.3f}")
    report[name] = entry
    peer.close()
    del peer, kv
    torch.cuda.empty_cache()
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    parser.add_argument("--check-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 6])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--skip-mla", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    ok, reason = available()
    print(f"{'PASS' if ok else 'FAIL'} available: {reason}", flush=True)
    if not ok:
        return 1
    import torch

    lm = _load()
    print(f"    torch {torch.__version__}, {torch.cuda.get_device_name()}, lmcache from "
          f"{lm.lmcache.__file__.rsplit('/', 2)[0]}")
    report: dict[str, Any] = {"lmcache_version": lm.version, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(), "available": reason}
    all_ok = True
    most = max(args.chunks + args.check_chunks)
    bs = 16
    try:
        # Llama-3-8B: 32 layers, 8 KV heads x 128, bf16, block 16.
        nb = 2 * most * (args.chunk_size // bs) + 64
        all_ok &= _run_layout("mha", "mha", (2, nb, bs, 8, 128), 32, bs, args, report)
        if not args.skip_mla:
            # DeepSeek-V3-like MLA: 61 layers x 576 (512 latent + 64 rope), bf16, block 16.
            all_ok &= _run_layout("mla", "mla", (nb, bs, 576), 61, bs, args, report)
        ceiling = memcpy_ceiling(most * report["mha"]["object_bytes"], args.iters, args.warmup)
        report["memcpy_ceiling"] = ceiling
        print(f"    pinned memcpy ceiling, {most} MHA chunks: D2H {ceiling['d2h_GBps']:.1f} GB/s, "
              f"H2D {ceiling['h2d_GBps']:.1f} GB/s")
        top = report["mha"]["bench"][-1]
        print(f"    MHA {top['chunks']} chunks vs memcpy: store {top['store_GBps'] / ceiling['d2h_GBps']:.2f}x, "
              f"retrieve {top['retrieve_GBps'] / ceiling['h2d_GBps']:.2f}x")
    except Exception as exc:
        import traceback

        traceback.print_exc()
        print(f"FAIL self-test raised {type(exc).__name__}: {exc}")
        all_ok = False
    report["pass"] = all_ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("PASS lmcache peer self-test" if all_ok else "FAIL lmcache peer self-test", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
