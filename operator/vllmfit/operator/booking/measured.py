"""What the node agent measured, per replica, as the closed loop reads it (issue 34): which replicas
have started, what their processes hold, and the start gate of a replica's pod
(vllmfit.core.placement.observed decides; this reads the store). Hold the store's lock."""

from __future__ import annotations

from datetime import UTC, datetime

from vllmfit.core.observe import attribution
from vllmfit.core.placement import observed
from vllmfit.operator.booking.state import Store


def forget(store: Store, node: str | None = None) -> None:
    """Drop the samples of replicas no longer booked anywhere, and their starts: those sampled on
    `node` (its report; issue 32: not a pass over every replica of the fleet per report), or, with
    None, every one (the resync: a replica released whose node never reports again). Hold the lock."""
    ledger, samples_of = store.books.ledger, store.cache.footprints
    for n in [node] if node is not None else list(samples_of):
        samples = samples_of.get(n, {})
        for key, replica, index in [k for k in samples if not ledger.bookings_of(k[0], k[1])]:
            del samples[(key, replica, index)]
            store.cache.started.discard((key, replica))
        if not samples:
            samples_of.pop(n, None)
    if node is None:
        store.cache.started = {(k, r) for k, r in store.cache.started if ledger.bookings_of(k, r)}


def ready(store: Store, key: str, replica: int) -> bool:
    rec = store.cache.records.get(key)
    return rec is not None and any(r == replica and h.ready for r, h in rec.pods.values())


def started(store: Store, key: str, replica: int) -> bool:
    """Readiness, or the agent saw the footprint stable (vllmfit.core.placement.observed)."""
    return (key, replica) in store.cache.started or ready(store, key, replica)


def in_use(store: Store, node: str) -> dict[tuple[str, int, int], int]:
    """(deployment, replica, GPU) -> bytes its processes hold in the node's latest inventory."""
    att = store.cache.replica_usage.get(node)
    out = {}
    for who, units in (att.by_deployment.items() if att is not None else ()):
        key, _, rep = who.rpartition("#")
        for index, n in units.items():
            out[(key, int(rep), index)] = n
    return out


def gate(store: Store, key: str, replica: int, made_for: str | None = None,
         now: datetime | None = None) -> observed.Gate:
    """The start gate of one replica on the measured room of its node (observed.start_gate)."""
    mine = store.books.ledger.bookings_of(key, replica)
    node = mine[0].node if mine else ""
    att = store.cache.replica_usage.get(node)
    free = None if att is None else {i: u.free_bytes for i, u in att.units.items()}
    age = None
    if att is not None:
        try:
            age = (now or datetime.now(UTC)).timestamp() - attribution.parse_time(att.sampled_at).timestamp()
        except ValueError:
            age = None
    return observed.start_gate(store.books.ledger, key, replica, free, age, lambda k, r: started(store, k, r),
                               in_use(store, node), made_for=made_for)
