"""Chunk keys: one 16-byte digest per full chunk, chained over the prefix, salted, stable."""

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from lmcache_mp import chunk_hashes
from lmcache_mp.keys import DIGEST_BYTES

CHUNK = 16


def reference_hashes(tokens, chunk_size, salt=b""):
    """The documented scheme, written out independently: XXH3-128 over (previous digest ||
    chunk tokens as little-endian uint32), starting from a digest of the domain and the salt."""
    prev = xxhash.xxh3_128_digest(b"lmcache-mp/chunk/v1\0" + salt)
    out = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size:(i + 1) * chunk_size]
        prev = xxhash.xxh3_128_digest(prev + b"".join(int(t).to_bytes(4, "little") for t in chunk))
        out.append(prev)
    return out


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.int64)


@pytest.mark.parametrize("n_tokens", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK, 5 * CHUNK + 7])
def test_one_digest_per_full_chunk(n_tokens):
    tokens = _tokens(n_tokens)
    hashes = chunk_hashes(tokens, CHUNK)
    assert len(hashes) == n_tokens // CHUNK
    assert all(isinstance(h, bytes) and len(h) == DIGEST_BYTES for h in hashes)
    assert len(set(hashes)) == len(hashes)
    assert hashes == reference_hashes(tokens.tolist(), CHUNK)


def test_trailing_partial_chunk_does_not_change_the_digests():
    tokens = _tokens(3 * CHUNK + 5)
    assert chunk_hashes(tokens, CHUNK) == chunk_hashes(tokens[: 3 * CHUNK], CHUNK)


@pytest.mark.parametrize("i", [0, 5, CHUNK - 1, CHUNK, 2 * CHUNK + 3, 4 * CHUNK - 1])
def test_changing_one_token_changes_its_chunk_and_every_later_one(i):
    tokens = _tokens(4 * CHUNK, seed=1)
    base = chunk_hashes(tokens, CHUNK)
    changed = tokens.copy()
    changed[i] = (changed[i] + 1) % 2**32
    after = chunk_hashes(changed, CHUNK)
    c = i // CHUNK
    assert after[:c] == base[:c]  # earlier chunks keep their keys
    assert all(a != b for a, b in zip(after[c:], base[c:], strict=True))  # this chunk and all later ones change


def test_prefix_chaining_same_chunk_after_different_prefixes():
    """A chunk's digest depends on everything before it, not only on its own tokens."""
    a, b, common = _tokens(CHUNK, 2), _tokens(CHUNK, 3), _tokens(CHUNK, 4)
    ha = chunk_hashes(np.concatenate([a, common]), CHUNK)
    hb = chunk_hashes(np.concatenate([b, common]), CHUNK)
    assert ha[1] != hb[1]
    assert chunk_hashes(common, CHUNK)[0] not in (ha[1], hb[1])


def test_shared_prefix_shares_keys():
    prefix = _tokens(3 * CHUNK, 5)
    h1 = chunk_hashes(np.concatenate([prefix, _tokens(2 * CHUNK, 6)]), CHUNK)
    h2 = chunk_hashes(np.concatenate([prefix, _tokens(2 * CHUNK, 7)]), CHUNK)
    assert h1[:3] == h2[:3] and h1[3] != h2[3]


def test_salt_changes_every_digest():
    tokens = _tokens(4 * CHUNK)
    plain = chunk_hashes(tokens, CHUNK)
    for salt in (b"tenant-a", b"tenant-b", b"\0"):
        salted = chunk_hashes(tokens, CHUNK, salt=salt)
        assert all(s != p for s, p in zip(salted, plain, strict=True))
        assert salted == reference_hashes(tokens.tolist(), CHUNK, salt)
    assert chunk_hashes(tokens, CHUNK, salt=b"tenant-a") != chunk_hashes(tokens, CHUNK, salt=b"tenant-b")
    assert chunk_hashes(tokens, CHUNK, salt=b"") == plain


def test_chunk_size_is_part_of_the_key():
    tokens = _tokens(64)
    assert chunk_hashes(tokens, 16)[1] != chunk_hashes(tokens, 32)[0]


@pytest.mark.parametrize("convert", [
    list,
    lambda t: np.asarray(t, dtype=np.int64),
    lambda t: np.asarray(t, dtype=np.uint32),
    lambda t: np.asarray(t, dtype=np.uint64),
    lambda t: np.asarray(t, dtype=">i8"),  # big-endian input still hashes the same token values
    lambda t: tuple(int(x) for x in t),
], ids=["list", "int64", "uint32", "uint64", "big-endian", "tuple"])
def test_accepts_lists_and_numpy_arrays_of_any_integer_dtype(convert):
    tokens = np.random.default_rng(8).integers(0, 2**31, 3 * CHUNK)
    assert chunk_hashes(convert(tokens), CHUNK) == reference_hashes(tokens.tolist(), CHUNK)


def test_small_dtypes_hash_like_their_values():
    tokens = np.arange(2 * CHUNK, dtype=np.uint16)
    assert chunk_hashes(tokens, CHUNK) == chunk_hashes(tokens.astype(np.int64).tolist(), CHUNK)


def test_token_id_extremes():
    tokens = [0] * CHUNK + [2**32 - 1] * CHUNK
    assert chunk_hashes(tokens, CHUNK) == reference_hashes(tokens, CHUNK)


def test_deterministic_across_processes():
    """Workers in different processes (and different PYTHONHASHSEEDs) must derive the same keys."""
    tokens = _tokens(3 * CHUNK, 9)
    code = (
        "import sys, numpy as np; from lmcache_mp import chunk_hashes; "
        "t = np.array([int(x) for x in sys.argv[1].split(',')]); "
        "print(','.join(h.hex() for h in chunk_hashes(t, int(sys.argv[2]), salt=b'abc')))"
    )
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code, ",".join(map(str, tokens.tolist())), str(CHUNK)],
                             env=env, capture_output=True, text=True, timeout=60, check=True)
        outs.append(out.stdout.strip())
    here = ",".join(h.hex() for h in chunk_hashes(tokens, CHUNK, salt=b"abc"))
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize("tokens, match", [
    ([-1] + [0] * (CHUNK - 1), r"\[0, 2\*\*32\)"),
    ([0] * (CHUNK - 1) + [2**32], r"\[0, 2\*\*32\)"),
    (np.full(CHUNK, -5, dtype=np.int32), r"\[0, 2\*\*32\)"),
    ([2**64] * CHUNK, "integers"),
    ([0.0] * CHUNK, "integers"),
    (np.ones(CHUNK, dtype=np.float32), "integers"),
    (["a"] * CHUNK, "integers"),
    (np.zeros((2, CHUNK), dtype=np.int64), "1-D"),
    (np.int64(3), "1-D"),
])
def test_rejects_bad_token_ids(tokens, match):
    with pytest.raises(ValueError, match=match):
        chunk_hashes(tokens, CHUNK)


@pytest.mark.parametrize("chunk_size", [0, -16])
def test_rejects_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_hashes([1, 2, 3], chunk_size)
