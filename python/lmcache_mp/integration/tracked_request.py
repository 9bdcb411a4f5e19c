"""What the scheduler keeps of one request (integration/scheduler_core.py and its parts): its
tokens and keys, its lookups and their leases, its block tables and what was stored of it."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lmcache_mp.integration.request_hints import RequestHint
from lmcache_mp.keys import chunk_hashes


@dataclass(eq=False)
class TrackedRequest:
    req_id: str
    token_ids: Sequence[int]  # live view: grows with generated tokens
    num_prompt_tokens: int
    salt: bytes
    generation: int
    cacheable: bool = True
    skip_load: bool = False
    skip_save: bool = False
    spans: Sequence[tuple[int, int, bytes]] = ()  # token ranges whose KV depends on more (see below)
    hashes: list[bytes] = field(default_factory=list)
    looked_up: bool = False
    asked_at: float = 0.0  # when the engine first asked for this admission's hit (time.perf_counter())
    engine_tokens: int = 0  # tokens vLLM's own prefix cache held when it asked
    hit_chunks: int = 0  # leading chunks every group has
    # Per group: leading chunks leased by our lookup and not yet loaded/released, and the id of
    # the server's lease on them.
    leased_chunks: list[int] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # leading chunks known to be on the server or planned to be stored
    # A store or load was ever planned: the workers then report the request finished once the
    # server answered them all, and its blocks stay allocated until then.
    has_transfers: bool = False
    tables: list[list[int]] = field(default_factory=list)  # block table per group
    pending: list[cf.Future] | None = None  # the prefix lookups (one per prefix group), while on their way
    # The state groups' lookups (boundary in chunks, group position, lookup), while on their way.
    pending_states: list[tuple[int, int, cf.Future]] | None = None
    hints: tuple[RequestHint, ...] = ()  # what the application asked of the server for it (request_hints.py)

    def chunk_keys(self, num_chunks: int, chunk_size: int) -> list[bytes]:
        """The keys of the first num_chunks chunks (computed once, as far as asked)."""
        if len(self.hashes) < num_chunks:
            n = num_chunks * chunk_size
            tokens = np.fromiter(itertools.islice(self.token_ids, n), dtype=np.int64, count=n)
            extras: dict[int, bytes] = {}
            for start, end, what in self.spans:  # every chunk the span overlaps depends on it
                for c in range(start // chunk_size, min(num_chunks, -(-end // chunk_size))):
                    extras[c] = extras.get(c, b"") + what + start.to_bytes(8, "little")
            self.hashes = chunk_hashes(tokens, chunk_size, salt=self.salt, extras=extras)
        return self.hashes[:num_chunks]
