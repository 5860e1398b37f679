"""Enforcement as the operator applies it: which enforcement a replica gets on its node (from the
node agent's inventory: vllmfit.backends.enforcement.choose), and the `Enforced` condition and
Event of a deployment with a replica that runs without one (docs/trust-model.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from vllmfit.backends import enforcement
from vllmfit.core.placement import Ledger
from vllmfit.operator.booking import report
from vllmfit.operator.booking.record import Record
from vllmfit.operator.booking.report import now, post_event
from vllmfit.operator.booking.state import Store
from vllmfit.operator.rendering import builders

logger = logging.getLogger(__name__)
CONDITION = "Enforced"


def mode(store: Store, node: str) -> str:
    """The enforcement a sharing replica gets on `node` (what its latest inventory reports)."""
    att = store.cache.attributions.get(node)
    return enforcement.choose(att.enforcement if att is not None else (), store.options.mps is not None)


def first_modes(store: Store, rec: Record, ledger: Ledger) -> dict[int, tuple[str, str]] | None:
    """What `report_modes` will be told once the Deployments of a record that has none are
    written (handlers.children.sync_children, each replica written anew): each replica's (node,
    mode), for its first status, so that writing the Deployments does not need a second status
    write. `ledger`: the one the record was just booked on. None when that is not known before
    they are written: a record with children or with an `Enforced` condition already, a DRA
    replica (its claim template is made then), a group across nodes, a replica waiting for
    drains. A wrong guess costs only that second write."""
    if rec.children or not rec.admitted or rec.going or any(c.type == CONDITION for c in rec.conditions):
        return None
    if store.books.drains.of(rec.key):
        return None
    modes: dict[int, tuple[str, str]] = {}
    for p in rec.placement:
        if p.workers or store.backend_of(p.node) == "dra":
            return None
        whole = builders.exclusive(ledger, rec.key, p.node, [g.index for g in p.gpus])
        modes[p.replica] = (p.node, enforcement.of_pod(whole, not whole, mode(store, p.node),
                                                       store.options.mps is not None))
    return modes


async def report_modes(store: Store, rec: Record, modes: Mapping[int, tuple[str, str]]) -> bool:
    """`Enforced` from each written replica's (node, mode): True when every one is enforced (or has
    its node to itself), else False naming the replicas that run without it, with a Warning Event
    (once per message). Returns whether it newly said a replica runs without one (the caller counts it:
    vllmfit_not_enforced_total)."""
    if _unchanged(rec, modes):
        return False  # what its first status said already (first_modes): no lock, no write
    async with store.books.changing():
        return said(store, rec, modes) is not None


def _condition(modes: Mapping[int, tuple[str, str]]) -> tuple[str, str, str, bool]:
    """(status, reason, message, whether a replica runs without enforcement) of `Enforced`."""
    bare = [f"replica {r} on {node}" for r, (node, m) in sorted(modes.items()) if m == enforcement.NONE]
    status, reason = ("False", "NotEnforced") if bare else ("True", "Enforced")
    message = (f"{', '.join(bare)}: the node reports no per-container GPU memory limit (NVIDIA driver r615+ or an "
               "MPS daemon): its booking is counted, not enforced" if bare else
               "; ".join(f"replica {r}: {m}" for r, (_, m) in sorted(modes.items())) or "no replica runs")
    return status, reason, message, bool(bare)


def _unchanged(rec: Record, modes: Mapping[int, tuple[str, str]]) -> bool:
    old = next((c for c in rec.conditions if c.type == CONDITION), None)
    return old is not None and (old.status, old.reason, old.message) == _condition(modes)[:3]


def said(store: Store, rec: Record, modes: Mapping[int, tuple[str, str]], *, post: bool = True) -> str | None:
    """report_modes, in a change the caller holds (Books.changing). Returns what it newly says of
    the replicas that run without enforcement (None: nothing new, or every one enforced), posted
    as a `NotEnforced` Warning Event unless `post` is False: the admission that books it says it
    in its own Event (handlers.decide.apply_decision: one Event a decision)."""
    if _unchanged(rec, modes):
        return None
    status, reason, message, bare = _condition(modes)
    if bare and post:
        post_event(rec.body, "Warning", reason, message)
    rec.conditions = report.set_condition(rec.conditions, CONDITION, status, reason, message, now(), rec.generation)
    store.writer.mark([rec.key])
    return message if bare else None
