"""The engine's own copies (registrations with transfer="engine"): the engine's `EngineCopies` part.

Without MPS a GPU runs the kernels of one CUDA context at a time, so packing kernels of the
server's context take the engine's time slice. For a registration made with transfer="engine"
the engine's process moves the bytes itself, in its own context: it maps L1 (MAP_ARENA: the
arena's file descriptor, passed over a local-lane connection) and copies between its KV cache
and the arena; the server allocates, indexes, leases and commits, and never touches the GPU.

- RESERVE: slots for the chunks of a store that are not stored yet (begin_store), held for the
  client until its COMMIT, which commits them (visible to lookups only then) or gives them back.
- READ: the leading stored chunks (loaded from L2 first where only L2 has them), pinned for the
  client (not evicted, moved or reused) until its READ_DONE.

Trust: whoever maps L1 can read and write every chunk in it. MAP_ARENA is answered only on the
local lane (a unix socket: for an ipc:// endpoint, a file of mode 0600, or 0660 of --ipc-group)
and only to processes of this server's user, root, or --ipc-group (the kernel's credentials of
the connecting process). On a server with tenants, a process maps its tenant's window instead of
L1 (tenancy/windows.py): the offsets of RESERVE and READ replies are into the window, and the
server copies between it and L1.

A client that goes away (BYE, its heartbeats stop) has its reads ended at once; its
reservations are held until its process is gone (a copy of it may still be landing in those
slots), then given back: nothing of them ever becomes visible. When the server cannot see the
client's process (another pid namespace), they are held for ORPHAN_HOLD_S instead.
"""

from __future__ import annotations

import grp
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from lmcache_mp import protocol as p
from lmcache_mp.config import ServerConfig
from lmcache_mp.keys import DIGEST_BYTES
from lmcache_mp.native import HostArena
from lmcache_mp.processes import process_start
from lmcache_mp.server import validation as check
from lmcache_mp.server.copies.server_copies import INLINE_CHUNKS, BytesMoved, ServerCopies, check_deadline
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.registry.registrations import Entry, Registrations
from lmcache_mp.server.request import Request
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.tenancy.windows import Slots, TenantWindows
from lmcache_mp.server.validation import RequestFailure, chunk_keys, over_limit, parent_key, shared_keys
from lmcache_mp.storage.l1 import L1Store, StorePlan

logger = logging.getLogger(__name__)

ORPHAN_HOLD_S = 60.0  # reservations of a client gone from view, whose process cannot be watched
MAX_HELD = 8192  # reservations and reads one client may hold at once


@dataclass
class Holder:
    """One client's reservations and reads, and what is known of its process."""

    pid: int = 0
    start: int | None = None
    reservations: dict = field(default_factory=dict)  # id -> (plan, object_bytes, window Slots or None)
    reads: dict = field(default_factory=dict)  # id -> the L1 objects read (or, with tenants, window Slots)
    gone_at: float = 0.0  # when the client was forgotten (0: it is not)

    def process_gone(self) -> bool:
        return bool(self.pid) and process_start(self.pid) != self.start


class EngineCopies:
    def __init__(self, config: ServerConfig, arena: HostArena, l1: L1Store, session_id: bytes,
                 registrations: Registrations, clients: Clients, server_copies: ServerCopies, moved: BytesMoved):
        """server_copies: reads find their chunks (loading from L2 first) as retrieves do."""
        self.config = config
        self.arena = arena
        self.l1 = l1
        self.session_id = session_id
        self.registrations = registrations
        self.clients = clients
        self.server_copies = server_copies
        self.moved = moved
        self.tenancy: Tenancy | NoTenancy = NoTenancy()  # (MPCacheEngine.attach_tenancy)
        self._holders: dict[bytes, Holder] = {}
        self._holders_lock = threading.Lock()
        self._held_ids = itertools.count(1)
        self.windows = TenantWindows(self.arena.slab_bytes)  # (used on a server with tenants only)
        self._group_gid = None
        if self.config.ipc_group:
            g = self.config.ipc_group
            self._group_gid = int(g) if g.isdigit() else grp.getgrnam(g).gr_gid

    def close(self) -> None:
        self.windows.close()

    # ---- MAP_ARENA ---------------------------------------------------------------------------

    def _may_map(self, pid: int, uid: int, gid: int) -> bool:
        if uid in (0, os.getuid()):
            return True
        if self._group_gid is None:
            return False
        if gid == self._group_gid:
            return True
        try:  # supplementary groups
            with open(f"/proc/{pid}/status") as f:
                groups = next((ln.split()[1:] for ln in f if ln.startswith("Groups:")), [])
            return str(self._group_gid) in groups
        except OSError:
            return False

    def map_arena(self, request: Request) -> None:
        msg: p.MapArena = request.msg
        conn = request.lane
        if conn is None:
            raise RequestFailure(p.ErrorCode.UNSUPPORTED, "MAP_ARENA is answered on the local lane only (a file "
                                 "descriptor cannot cross ZeroMQ)")
        check.client_id(msg.client_id)
        pid, uid, gid = conn.peer
        tenant = request.tenant
        if tenant is None and not self._may_map(pid, uid, gid):
            raise RequestFailure(p.ErrorCode.UNSUPPORTED, f"a process of user {uid} may not map this server's L1 "
                                 "(only its own user, root or --ipc-group may): copies stay in the server")
        self.clients.touch(msg.client_id)
        with self._holders_lock:
            h = self._holders.setdefault(msg.client_id, Holder())
            h.pid, h.start = pid, process_start(pid) if pid else None
        arena = self.windows.of(tenant).arena if tenant is not None else self.arena
        logger.debug("%s mapped by pid %d (client %s)", f"tenant {tenant.name}'s window" if tenant else "L1", pid,
                     msg.client_id.hex()[:8])
        request.reply(p.MapArenaReply(capacity=arena.capacity, slab_bytes=arena.slab_bytes,
                                      session_id=self.session_id), fds=(arena.fd,))

    # ---- stores ------------------------------------------------------------------------------

    def _engine_entry(self, kv_id: int, client_id: bytes) -> Entry:
        entry = self.registrations.entry(kv_id, client_id)
        if entry.ctx.transfer_mode != "engine":
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, "this KV cache was registered for the server's "
                                 "copies: use STORE and RETRIEVE")
        return entry

    def _holder(self, client_id: bytes) -> Holder:
        """(holders lock held) The client's holder; LIMIT_EXCEEDED when it holds too much."""
        h = self._holders.setdefault(client_id, Holder())
        if len(h.reservations) + len(h.reads) >= MAX_HELD:
            raise over_limit(f"this client holds {MAX_HELD} reservations and reads, the most allowed: commit or "
                             "finish some first")
        return h

    def _on_registration(self, request: Request, run) -> None:
        """run(entry, msg, request) in the registration's order (on the socket thread when small and
        the registration idle, as a store or retrieve of the server's copies)."""
        msg: p.Reserve | p.Read = request.msg
        entry = self._engine_entry(msg.kv_id, msg.client_id)
        self.clients.touch(msg.client_id)
        entry.run(request.job(lambda: run(entry, msg, request)),
                  inline=len(msg.hashes) // DIGEST_BYTES <= INLINE_CHUNKS, limit=self.config.max_queued_requests)

    def reserve(self, request: Request) -> None:
        self._on_registration(request, self._run_reserve)

    def _run_reserve(self, entry: Entry, msg: p.Reserve, request: Request) -> None:
        reply = request.reply
        request.mark("started")
        reg = entry.ctx.reg
        keys = chunk_keys(reg, msg.hashes, msg.salt)
        parent = parent_key(reg, msg.parent, msg.salt)
        if msg.shared:
            shared = self.tenancy.shared_of(reg.model)
            keys, parent = shared_keys(shared, keys), parent and shared_keys(shared, [parent])[0]
        check_deadline(msg)
        with self._holders_lock:
            holder = self._holder(msg.client_id)
        plan = self.l1.begin_store(keys, reg.object_bytes, reg.format_key, parent)
        request.mark("in L1")
        slots = self._window_slots(request, plan, reg.object_bytes)
        if not plan.objects:
            def answer(failed: int) -> None:  # once the chunks others were writing landed
                reply(p.ReserveReply(reservation=0, chunks=b"", offsets=b"", object_bytes=reg.object_bytes,
                                     present=plan.present + len(plan.pending) - failed,
                                     skipped=plan.skipped + failed))

            self.l1.when_written(plan.pending, answer)
            return
        rid = next(self._held_ids)
        with self._holders_lock:
            holder.reservations[rid] = (plan, reg.object_bytes, slots)
        reply(p.ReserveReply(reservation=rid, chunks=p.pack_block_ids(plan.indices),
                             offsets=p.pack_offsets(slots.offsets if slots else [o.offset for o in plan.objects]),
                             object_bytes=reg.object_bytes, present=plan.present, skipped=plan.skipped))

    def commit(self, request: Request) -> None:
        msg: p.Commit = request.msg
        reply = request.reply
        self.clients.touch(msg.client_id)
        with self._holders_lock:
            holder = self._holders.get(msg.client_id)
            held = holder.reservations.pop(msg.reservation, None) if holder is not None else None
        if held is None:
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, f"no reservation {msg.reservation} of this client "
                                 "(committed already, or the server restarted)")
        plan, object_bytes, slots = held
        if not msg.ok:
            self._abort(plan, slots)
            reply(p.CommitReply(stored=0, present=plan.present, skipped=plan.skipped + len(plan.objects)))
            return
        if slots is not None:  # the bytes landed in the tenant's window: into L1 now, before anyone can see them
            slots.window.copy_out(slots, self.arena.base, [o.offset for o in plan.objects], object_bytes)
            slots.release()
        self.l1.commit(plan)
        self.moved.count("store", len(plan.objects) * object_bytes)

        def answer(failed: int) -> None:
            reply(p.CommitReply(stored=len(plan.objects), present=plan.present + len(plan.pending) - failed,
                                skipped=plan.skipped + failed))

        self.l1.when_written(plan.pending, answer)

    # ---- retrieves ---------------------------------------------------------------------------

    def read(self, request: Request) -> None:
        self._on_registration(request, self._run_read)

    def _run_read(self, entry: Entry, msg: p.Read, request: Request, held: list | None = None) -> None:
        def again(objs: list) -> None:  # after L2 loads, on the registration's worker
            entry.run(request.job(lambda: self._run_read(entry, msg, request, held=objs)))

        reply = request.reply
        objs = self.server_copies.read_objects(entry, msg, request, held, again)
        if objs is None:
            return  # loading from L2; runs again
        reg = entry.ctx.reg
        keep = objs  # what the read holds until its READ_DONE
        tenant = request.tenant
        if tenant is not None and objs:  # copied into the tenant's window; L1's objects go at once
            window = self.windows.of(tenant)
            keep = window.take(reg.object_bytes, len(objs))
            window.copy_in(keep, self.arena.base, [o.offset for o in objs[:len(keep.offsets)]], reg.object_bytes)
            self.l1.end_read(objs)
            objs = objs[:len(keep.offsets)]
        if not objs:
            reply(p.ReadReply(read=0, offsets=b"", object_bytes=reg.object_bytes))
            return
        try:
            with self._holders_lock:
                holder = self._holder(msg.client_id)
                rid = next(self._held_ids)
                holder.reads[rid] = keep
        except RequestFailure:
            self._end_read(keep)
            raise
        self.moved.count("retrieve", len(objs) * reg.object_bytes)
        offsets = keep.offsets if isinstance(keep, Slots) else [o.offset for o in objs]
        reply(p.ReadReply(read=rid, offsets=p.pack_offsets(offsets), object_bytes=reg.object_bytes))

    def read_done(self, request: Request) -> None:
        msg: p.ReadDone = request.msg
        with self._holders_lock:
            holder = self._holders.get(msg.client_id)
            objs = holder.reads.pop(msg.read, None) if holder is not None else None
        if objs is None:
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, f"no read {msg.read} of this client (finished "
                                 "already, or the server restarted)")
        request.reply(p.ReadDoneReply(released=self._end_read(objs)))

    def _end_read(self, held) -> int:
        """A read is over: its L1 objects are let go, or its window slots given back."""
        if isinstance(held, Slots):
            return held.release()
        self.l1.end_read(held)
        return len(held)

    def _abort(self, plan: StorePlan, slots: Slots | None) -> None:
        self.l1.abort(plan)
        if slots is not None:
            slots.release()

    def _window_slots(self, request: Request, plan: StorePlan, object_bytes: int) -> Slots | None:
        """With tenants: the window slots a reservation's chunks are copied into, one per object
        of the plan; the objects beyond what the window has free are given back (skipped)."""
        tenant = request.tenant
        if tenant is None or not plan.objects:
            return None
        slots = self.windows.of(tenant).take(object_bytes, len(plan.objects))
        cut = len(slots.offsets)
        if cut < len(plan.objects):
            self.l1.abort(StorePlan(indices=plan.indices[cut:], objects=plan.objects[cut:], present=0, skipped=0))
            plan.skipped += len(plan.objects) - cut
            del plan.indices[cut:], plan.objects[cut:]
        return slots

    # ---- clients that go away ----------------------------------------------------------------

    def client_gone(self, client: bytes) -> None:
        """The client was forgotten: its reads end now; its reservations once its process is."""
        with self._holders_lock:
            holder = self._holders.get(client)
            if holder is None:
                return
            reads, holder.reads = list(holder.reads.values()), {}
            holder.gone_at = holder.gone_at or time.monotonic()
        for objs in reads:
            self._end_read(objs)
        self.reap_reservations()

    def reap_reservations(self) -> None:
        """Give back the reservations of clients that were forgotten and whose process is gone (or,
        unseen, after ORPHAN_HOLD_S): no copy of theirs can land any more (called on ticks)."""
        now = time.monotonic()
        dropped, reads = [], []
        with self._holders_lock:
            for client, h in list(self._holders.items()):
                dead = h.process_gone()
                if not (dead or h.gone_at):
                    continue  # a live client: what it holds is its own business
                if h.reservations and not dead and (h.pid or now - h.gone_at <= ORPHAN_HOLD_S):
                    continue  # forgotten, but its process (or one we cannot see) may still be copying
                dropped += [(plan, slots) for plan, _, slots in h.reservations.values()]
                reads += h.reads.values()
                del self._holders[client]
        for objs in reads:
            self._end_read(objs)
        for plan, slots in dropped:
            self._abort(plan, slots)
        if dropped:
            logger.info("gave back %d reservations of clients whose processes are gone (nothing of them was "
                        "committed)", len(dropped))

    def status(self) -> dict:
        with self._holders_lock:
            return {"clients": len(self._holders),
                    "reservations": sum(len(h.reservations) for h in self._holders.values()),
                    "reads": sum(len(h.reads) for h in self._holders.values()),
                    "held_for_gone_clients": sum(len(h.reservations) for h in self._holders.values() if h.gone_at),
                    **({"tenant_windows": self.windows.stats()} if self.tenancy.enabled else {})}
