"""Every Redis key the gate uses, built in one place.

All keys of one deal share the hash tag `{d:ID}`, so every script touches a single
slot and runs unchanged on Redis Cluster. Scripts receive their keys only through
KEYS, never by building names inside Lua.
"""

from __future__ import annotations

from dataclasses import dataclass

# Deals whose Redis state is loaded; the janitor and the resync loop walk this set.
# It lives outside any deal's slot and is only ever touched by plain commands.
ACTIVE_DEALS = "gate:deals"
# The global limiter of the reservation endpoint, in a slot of its own.
GLOBAL_LIMIT = "{gate}:rl:global"
# A fresh random value written after every deal creation: gate processes drop what
# they remember about unknown deal ids when it changes
# (gate/inventory/unknown_deals.py UnknownDeals).
DEALS_GENERATION = "gate:deals:generation"
# Deals that have a waiting room (gate/room/): the room loop advances each of them.
# Outside any deal's slot, touched by plain commands only, rebuilt from the database.
ROOMS = "gate:rooms"
# Deals whose waiting room was removed or whose sale ended, by when (ms) its keys are
# due for deletion (gate/room/retire.py). A plain key, touched by plain commands and
# lua/room_retire_done.lua only.
ROOMS_RETIRING = "gate:rooms:retiring"
# The database's health as every gate process saw it, per second of Redis time
# (gate/room/estimate.py): a hash with a short TTL, so at most a few exist at once.
ROOM_HEALTH_PREFIX = "gate:room:health:"


def room_health(second: int) -> str:
    return f"{ROOM_HEALTH_PREFIX}{second}"


@dataclass(frozen=True, slots=True)
class DealKeys:
    deal_id: int
    tag: str
    meta: str  # hash: nb, avail, start_ms, end_ms, max, limit, epoch
    buckets: str  # hash: bucket index -> available units
    users: str  # hash: user id -> units held or bought (per-user quota)
    # hash: marker id -> record. "T|…" an admission token (Redis already decremented,
    # the database not yet), "R|…" an intent (the database is changing, Redis not yet).
    inflight: str
    inflight_times: str  # zset: marker id -> creation time (Redis TIME, ms)
    resolved: str  # zset: "id|C|…" / "id|A|…" markers resolved in the last seconds
    sync_lock: str  # string: one sync pass per deal at a time across processes
    buyers: str  # set: users ever admitted to this deal (for the sold-out near-cache)
    # The waiting room (gate/room/, docs/waiting-room.md):
    room: str  # hash: on, aps, ttl_ms, pq_ms, clock and counters
    room_queue: str  # zset: user -> queue score (waiting tickets only)
    room_tickets: str  # hash: user -> "joined_ms|next_poll_ms" (every ticket)
    room_admitted: str  # hash: user -> "seq|admitted_ms|expires_ms" (unspent admissions)
    room_expiry: str  # zset: user -> expires_ms (unspent admissions)
    room_window: str  # zset: admission seq -> admitted_ms (the last second's admissions)
    # hash: HMAC of an access code -> "" (unbound) or the user id it is bound to. The
    # challenges spent are strings "{d:ID}:room:pow:<id>" with a TTL, the failed code
    # attempts' cells "{d:ID}:room:ca:u:<user>" and "{d:ID}:room:ca:i:<address>"
    # (room_ticket.lua builds these from `room`: one per buyer, in the deal's slot).
    room_codes: str
    # hash: user -> the next poll welcome (ms) of the ticket they left (room_leave.lua):
    # a later join of theirs queues at the back and binds no further access code.
    room_left: str
    # hash: the admissions ring (gate/room/conversion.py): 1 s slots "<field>:<i>",
    # "t:<i>"; at most 256 x 7 fields, expiring RING_TTL_MS after its last write.
    # admit.lua, which has no key to spare, names it as KEYS[room] .. ":rca".
    room_ring: str

    def idempotency(self, user_id: int, key: str) -> str:
        return f"{self.tag}:k:{user_id}:{key}"

    def limiters(self, user_id: int, ip: str, device: str | None) -> tuple[str, str, str, str]:
        """The deal-slot limiter keys, in the KEYS order of admit.lua (deal, user,
        ip, device). Without a device id the device slot is a placeholder that is never
        touched: `RateLimits` turns the device limiter off for such a request."""
        return (
            f"{self.tag}:rl:d",
            f"{self.tag}:rl:u:{user_id}",
            f"{self.tag}:rl:i:{ip}",
            f"{self.tag}:rl:v:{device or '-'}",
        )

    @property
    def room_state(self) -> tuple[str, str, str, str, str, str]:
        """The waiting room's keys, in the KEYS order of the room_*.lua scripts."""
        return (
            self.room,
            self.room_queue,
            self.room_tickets,
            self.room_admitted,
            self.room_expiry,
            self.room_window,
        )

    @property
    def state(self) -> tuple[str, str, str, str, str, str]:
        """Counters and markers, in the KEYS order of apply.lua and sync_deal.lua."""
        return (
            self.meta,
            self.buckets,
            self.users,
            self.inflight,
            self.inflight_times,
            self.resolved,
        )


_cache: dict[int, DealKeys] = {}
_part_cache: dict[tuple[int, int], DealKeys] = {}

# Deal partitions (docs/scale-out.md, "Deal partitions"): at most this many per deal.
PARTITIONS_MAX = 16


def deal_keys(deal_id: int) -> DealKeys:
    keys = _cache.get(deal_id)
    if keys is None:
        keys = _make_keys(deal_id, f"{{d:{deal_id}}}")
        if len(_cache) < 100_000:
            _cache[deal_id] = keys
    return keys


def partition_keys(deal_id: int, k: int) -> DealKeys:
    """The keys of partition k of a deal: partition 0 is the deal's own tag {d:ID}
    (a deal of one partition is unchanged), partition k > 0 has the tag {d:ID:k}, so
    on a Redis Cluster the partitions of one deal land in different slots. Each
    holds the same fields for its own buckets (b MOD P = k) and the buyers routed to
    it; its `deal_id` is the deal's."""
    if k == 0:
        return deal_keys(deal_id)
    keys = _part_cache.get((deal_id, k))
    if keys is None:
        keys = _make_keys(deal_id, f"{{d:{deal_id}:{k}}}")
        if len(_part_cache) < 100_000:
            _part_cache[(deal_id, k)] = keys
    return keys


def home_partition(user_id: int, partitions: int) -> int:
    """The partition a buyer is routed to first: stable for a buyer and a deal's P
    (user ids are integers; the multiplier spreads consecutive ids)."""
    return ((user_id * 0x9E3779B1) >> 7) % partitions


def _make_keys(deal_id: int, tag: str) -> DealKeys:
    return DealKeys(
        deal_id=deal_id,
        tag=tag,
        meta=f"{tag}:meta",
        buckets=f"{tag}:b",
        users=f"{tag}:u",
        inflight=f"{tag}:f",
        inflight_times=f"{tag}:ft",
        resolved=f"{tag}:done",
        sync_lock=f"{tag}:sl",
        buyers=f"{tag}:buyers",
        room=f"{tag}:room",
        room_queue=f"{tag}:rq",
        room_tickets=f"{tag}:rt",
        room_admitted=f"{tag}:ra",
        room_expiry=f"{tag}:rx",
        room_window=f"{tag}:rw",
        room_codes=f"{tag}:rcodes",
        room_left=f"{tag}:rleft",
        room_ring=f"{tag}:room:rca",
    )


@dataclass(frozen=True, slots=True)
class OwnerKeys:
    """The keys of one gate process's liveness lease (gate/store/process_lease.py), hash-tagged per
    owner: the lease and its connection record live in one slot."""

    owner: str
    lease: str  # string, short TTL: the owner is alive while it exists
    conns: str  # hash: "_" -> "host pid"; server thread id -> connected at (Redis ms)


def owner_keys(owner: str) -> OwnerKeys:
    tag = f"{{gate:o:{owner}}}"
    return OwnerKeys(owner=owner, lease=f"{tag}:lease", conns=f"{tag}:conns")


def console_revoked(session_id: str) -> str:
    """A signed-out console session (gate/console/session.py), until it would expire."""
    return f"gate:console:revoked:{session_id}"


def room_fairness_limit(address: str) -> str:
    """The GCRA cell of one client address's fairness document reads (gate/room/
    fairness_doc.py, lua/limit.lua): across deals, a slot of its own per address."""
    return f"gate:room:fair:{address}"


def admin_attempts(address: str) -> str:
    """sorted set: one client address's recent attempts at the admin token, the admin
    API's failures and the console's sign-ins alike (gate/web/admin_guard.py)."""
    return f"gate:admin:attempts:{address}"


# Queue mode (gate/queuemode/): deals that have (or had) a request queue, walked by the
# consumers; outside any deal's slot, touched only by plain commands.
QUEUE_DEALS = "gate:q:deals"


def queue_order_index(order_id: str) -> str:
    """string: the deal id of a queued order (GET /v1/orders/{id} finds its slot)."""
    return f"gate:q:i:{order_id}"


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """A deal's request queue (docs/queue-mode.md), in the deal's slot."""

    deal_id: int
    stream: str  # stream: one entry per queued request; consumer group "gate"

    def status(self, order_id: str) -> str:
        """string: "Q|enqueued ms|attempts" waiting, "C|…" being committed,
        "X|REASON" rejected (final)."""
        return f"{{d:{self.deal_id}}}:q:o:{order_id}"


def queue_keys(deal_id: int) -> QueueKeys:
    return QueueKeys(deal_id=deal_id, stream=f"{{d:{deal_id}}}:q")
