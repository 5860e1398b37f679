"""The resync's correction of the ledger (issue 32): what the cluster says (each GPU node read
from its Node object, each admitted VLLMDeployment's bookings read from its status, the drains)
compared with what the writer's ledger holds, and only what differs changed, on a fork.

The resync used to build a new ledger from the listing every period (about 2 ms of CPU per
deployment, a new committed snapshot each time). The result here is the same ledger, as
`tests/operator/test_resync_mirror.py` checks against a fresh rebuild, but an idle period
changes nothing and publishes nothing: a ledger that already says what the cluster says is
kept. The ledger is never believed over the cluster: every node and every status is still
compared each period, so a drift (a missed event, a write lost, an object changed behind the
operator's back) is corrected at the next resync. No I/O here (booking.state.Store.resync)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from vllmfit.core.placement import Booking, Ledger, NodeInfo
from vllmfit.operator.booking import draining


@dataclass
class Corrected:
    """What one resync found different from the writer's ledger (all zero: nothing changed)."""

    nodes: int = 0  # nodes set or removed
    deployments: int = 0  # deployments whose bookings were restored or released
    drains: int = 0  # drains whose charge changed

    def __bool__(self) -> bool:
        return bool(self.nodes or self.deployments or self.drains)


def _order(b: Booking) -> tuple[int, str, int]:
    return b.replica, b.node, b.index


def same(a: Sequence[Booking], b: Sequence[Booking]) -> bool:
    """The same bookings, in any order."""
    return len(a) == len(b) and (list(a) == list(b) or sorted(a, key=_order) == sorted(b, key=_order))


def correct(ledger: Ledger, nodes: Mapping[str, NodeInfo], bookings: Mapping[str, Sequence[Booking]],
            *, keep: Container[str] = ()) -> tuple[Ledger, Corrected]:
    """A fork of `ledger` whose nodes are `nodes` and whose deployments' bookings are
    `bookings` (what the cluster says; a drain's own key is left alone, see `recharge`), with
    only what differs changed: a node whose info differs is set again, one not in `nodes`
    removed, a deployment whose bookings differ restored, one not in `bookings` released.
    `keep`: nodes left as they are (the DRA nodes: Store.overlay_dra sets them after). A status
    that books one GPU twice for one replica is released and restored like any other (the ledger
    counts such a replica once: Ledger.add_bookings)."""
    return _patch(ledger.fork(), nodes, bookings, keep)


def _patch(work: Ledger, nodes: Mapping[str, NodeInfo], bookings: Mapping[str, Sequence[Booking]],
           keep: Container[str]) -> tuple[Ledger, Corrected]:
    found = Corrected()
    for name in [n for n in work.nodes if n not in nodes and n not in keep]:
        found.nodes += put_node(work, name, None)
    for name, info in nodes.items():
        if name not in keep:
            found.nodes += put_node(work, name, info)
    for key in [k for k in work.deployments() if k not in bookings and not draining.is_drain(k)]:
        work.release(key)
        found.deployments += 1
    for key, bs in bookings.items():
        if not same(work.bookings_of(key), bs):
            work.restore(key, bs)
            found.deployments += 1
    return work, found


def put_node(ledger: Ledger, name: str, info: NodeInfo | None) -> bool:
    """Make node `name` in `ledger` be `info` (None: not there), changing it only when it differs
    (a node set again is re-indexed and makes a new version); returns whether it changed. The
    resync's correction and the DRA overlay (Store.overlay_dra) both go through it."""
    if info is None:
        if name not in ledger.nodes:
            return False
        ledger.remove_node(name)
        return True
    if ledger.nodes.get(name) == info:
        return False
    ledger.set_node(info)
    return True


def recharge(work: Ledger, drains: Mapping[str, draining.Drain], before: Ledger, found: Corrected) -> None:
    """Charge every drain into `work` again, in the order a rebuild charges them
    (draining.carry), and forget drain keys no drain has; count in `found` the drains whose
    charge differs from `before` (the ledger the resync started from)."""
    held = [k for k in work.deployments() if draining.is_drain(k)]
    if not held and not drains:
        return
    for key in held:
        work.release(key)
    draining.carry(work, drains)
    found.drains += sum(1 for k in {*held, *drains} if not same(work.bookings_of(k), before.bookings_of(k)))
