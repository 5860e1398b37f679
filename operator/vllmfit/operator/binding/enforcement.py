"""Enforcement as the operator applies it: which enforcement a replica gets on its node (from the
node agent's inventory: vllmfit.backends.enforcement.choose), and the `Enforced` condition and
Event of a deployment with a replica that runs without one (docs/trust-model.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from vllmfit.backends import enforcement
from vllmfit.operator.booking import report
from vllmfit.operator.booking.record import Record
from vllmfit.operator.booking.report import now, post_event
from vllmfit.operator.booking.state import Store

logger = logging.getLogger(__name__)
CONDITION = "Enforced"


def mode(store: Store, node: str) -> str:
    """The enforcement a sharing replica gets on `node` (what its latest inventory reports)."""
    att = store.cache.attributions.get(node)
    return enforcement.choose(att.enforcement if att is not None else (), store.options.mps is not None)


async def report_modes(store: Store, rec: Record, modes: Mapping[int, tuple[str, str]]) -> bool:
    """`Enforced` from each written replica's (node, mode): True when every one is enforced (or has
    its node to itself), else False naming the replicas that run without it, with a Warning Event
    (once per message). Returns whether it newly said a replica runs without one (the caller counts it:
    vllmfit_not_enforced_total)."""
    bare = [f"replica {r} on {node}" for r, (node, m) in sorted(modes.items()) if m == enforcement.NONE]
    status, reason = ("False", "NotEnforced") if bare else ("True", "Enforced")
    message = (f"{', '.join(bare)}: the node reports no per-container GPU memory limit (NVIDIA driver r615+ or an "
               "MPS daemon): its booking is counted, not enforced" if bare else
               "; ".join(f"replica {r}: {m}" for r, (_, m) in sorted(modes.items())) or "no replica runs")
    old = next((c for c in rec.conditions if c.type == CONDITION), None)
    if old is not None and (old.status, old.reason, old.message) == (status, reason, message):
        return False
    if bare:
        post_event(rec.body, "Warning", reason, message)
    async with store.books.changing():
        rec.conditions = report.set_condition(rec.conditions, CONDITION, status, reason, message, now(),
                                                rec.generation)
        store.writer.mark([rec.key])
    return bool(bare)
