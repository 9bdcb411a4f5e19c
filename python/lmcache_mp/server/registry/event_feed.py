"""EVENTS: a reader's next window of L1's chunk events, filtered to the namespaces it names."""

from __future__ import annotations

from lmcache_mp import protocol as p
from lmcache_mp.server.validation import invalid, names, over_limit
from lmcache_mp.storage.events import EventLog


def check(msg: p.Events) -> None:
    if len(msg.models) > p.MAX_EVENT_MODELS:
        raise over_limit(f"{len(msg.models)} models in one EVENTS request, over the limit of {p.MAX_EVENT_MODELS}")
    for model in msg.models:
        names(model)
    if msg.since < 0 or not 1 <= msg.max_events <= p.MAX_EVENTS:
        raise invalid(f"since must not be negative and max_events in [1, {p.MAX_EVENTS}]")


def answer(log: EventLog, session_id: bytes, msg: p.Events, prefix: str = "", shared: str = "") -> p.EventsReply:
    """Scans at most max_events events (fewer are returned when the filter drops some); `next`
    says where the scan stopped. prefix: a tenant's (server/tenancy/tenancy.py): only its namespace's
    events, its models named as its clients name them. shared: the shared namespace's prefix, for
    a tenant that reads it: its events too (they are hits of the tenant's lookups), each model named
    as the tenant's clients name it and listed in the reply's `shared`."""
    check(msg)
    first, nxt, events = log.read(msg.since, msg.max_events)
    if events:
        nxt = events[-1][0] + 1
    wanted = set(msg.models)
    if shared and wanted:  # (msg.models are the tenant's scoped names: the shared namespace's of the same)
        wanted |= {shared + m[len(prefix):] for m in msg.models}
    index: dict[str, int] = {}
    out = []
    for seq, kind, key in events:
        model = key.model
        if wanted and model not in wanted or prefix and not (
                model.startswith(prefix) or shared and model.startswith(shared)):
            continue
        i = index.setdefault(model, len(index))
        out.append(p.ChunkEvent(seq=seq, kind=kind, model=i, world_size=key.world_size, rank=key.rank,
                                digest=key.digest, salt=key.salt))
    models = [m[len(shared if shared and m.startswith(shared) else prefix):] for m in index] if prefix else list(index)
    from_shared = [i for i, m in enumerate(index) if shared and m.startswith(shared)]
    return p.EventsReply(session_id=session_id, first=first, next=nxt, models=models, events=out, shared=from_shared)
