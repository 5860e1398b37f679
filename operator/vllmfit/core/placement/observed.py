"""The closed loop (issue 34): what the node agent measured corrects the ledger's bookings, marks
GPUs over budget, and gates every start. Pure: no I/O; the operator calls these under its lock.

Started. A replica has started (vLLM has allocated its KV cache, so its footprint will not grow
by more than noise) when its pod is Ready, or when the agent saw its footprint stable: two
consecutive inventories (different `sampledAt`) in which its processes on a GPU differ by at most
FOOTPRINT_STABLE_BYTES (`stable`). The agent publishes a change of more than that at once and an
unchanged inventory at least every AGENT_PUBLISH_SECONDS, so a footprint that stops moving is
seen stable at most one agent interval later.

The booking rule (`booked`). A started replica's booking on each of its GPUs is

    max(prediction, observed + OBSERVED_MARGIN_BYTES)

kept as `Footprint.observed_excess` over the prediction (`Footprint.predicted`, the floor): a
smaller observed footprint never shrinks a booking below the prediction. A replica not started,
or not measured in this inventory, keeps its booking as it is.

Over budget. A GPU whose bookings plus foreign use exceed its budget after the change is over
budget: its headroom is negative, so the search places no newcomer there (nothing fits a negative
headroom) until it is back within budget; `holders` names who holds what for the condition and
Event; the operator re-places the deployments booked there that have not started anywhere.

The start gate (`start_gate`). A replica is released only when the agent's latest inventory of
each of its GPUs shows, free (NVML total - used), at least what the replica still needs (its
booking minus what its own processes already hold there) beside what the other booked replicas
that have not started yet still need. A node whose inventory is older than
START_GATE_MAX_AGE_SECONDS holds the gate and says so; a node without any inventory (no agent)
releases on its reservation alone, said in the reason (an explicit, visible fail-open: the chart
runs the agent on every GPU node).

`change` computes what the measurements change, as data; `apply` is the one function that changes
the ledger for them. The operator calls it in one critical section of its node handler: `floor`
(the node's bookings back to their predictions) before a re-plan for a change of the node itself,
so that a measurement never moves a started replica, then `change` from the same inventory, which
puts back (`kept`) what is not measured again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from vllmfit.core import defaults
from vllmfit.core.memory import fmt_gib
from vllmfit.core.placement.decision import Booking
from vllmfit.core.placement.inputs import GpuKey
from vllmfit.core.placement.ledger import Ledger


@dataclass(frozen=True)
class Measured:
    """One replica's processes on one GPU in one inventory."""

    deployment: str
    replica: int
    node: str
    index: int
    used_bytes: int
    started: bool


def stable(previous: tuple[str, int] | None, current: tuple[str, int],
           jitter: int = defaults.FOOTPRINT_STABLE_BYTES) -> bool:
    """Whether two consecutive samples, each (sampledAt, bytes), show a footprint that stopped
    moving: different samples, something measured, within `jitter` bytes of each other."""
    if previous is None or previous[0] == current[0] or current[1] <= 0:
        return False
    return abs(current[1] - previous[1]) <= jitter


def booked(predicted: int, observed: int, margin: int = defaults.OBSERVED_MARGIN_BYTES) -> int:
    """The booking of a started replica on one GPU: max(prediction, observed + margin)."""
    return max(predicted, observed + margin)


@dataclass(frozen=True)
class Grown:
    """One booking the measurements changed (for the Event and the learned record)."""

    deployment: str
    replica: int
    node: str
    index: int
    predicted: int
    observed: int
    before: int
    after: int


@dataclass(frozen=True)
class Change:
    """What the measurements change in the ledger: every booking of each changed deployment."""

    bookings: Mapping[str, tuple[Booking, ...]]
    grown: tuple[Grown, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.bookings)


def change(ledger: Ledger, measured: Iterable[Measured], margin: int = defaults.OBSERVED_MARGIN_BYTES,
           kept: Mapping[tuple[str, int, str, int], int] | None = None) -> Change:
    """The bookings `measured` changes by the booking rule (module docstring); nothing else moves.
    `kept`: (deployment, replica, node, GPU) -> the measured excess booked before `floor` took it
    off; a booking this inventory does not measure (started) again gets it back, and `Grown.before`
    counts it (so an unchanged measurement is no change)."""
    by = {(m.deployment, m.replica, m.node, m.index): m for m in measured}
    kept = kept or {}
    out: dict[str, tuple[Booking, ...]] = {}
    grown: list[Grown] = []
    for key in sorted({k[0] for k in by} | {k[0] for k, v in kept.items() if v}):
        new, changed = [], False
        for b in ledger.bookings_of(key):
            where = (b.deployment, b.replica, b.node, b.index)
            fp, m = b.footprint, by.get(where)
            had = kept.get(where, fp.observed_excess)
            excess = booked(fp.predicted, m.used_bytes, margin) - fp.predicted if m is not None and m.started else had
            if excess != fp.observed_excess:
                changed = True
                b = replace(b, footprint=replace(fp, observed_excess=excess))
            if excess != had:
                grown.append(Grown(key, b.replica, b.node, b.index, fp.predicted, m.used_bytes if m else 0,
                                   fp.predicted + had, b.footprint.total))
            new.append(b)
        if changed:
            out[key] = tuple(new)
    return Change(out, tuple(grown))


def floor(ledger: Ledger, node: str) -> Change:
    """Every booking on `node` back to its prediction (the view a re-plan for a change of the node
    itself decides on: a measurement never moves a started replica); `kept(ledger, node)` before
    it, passed to `change` after, puts back what the next inventory does not measure again."""
    out: dict[str, tuple[Booking, ...]] = {}
    for key in ledger.deployments_on(node):
        bs = ledger.bookings_of(key)
        if any(b.node == node and b.footprint.observed_excess for b in bs):
            out[key] = tuple(replace(b, footprint=replace(b.footprint, observed_excess=0)) if b.node == node else b
                             for b in bs)
    return Change(out)


def kept(ledger: Ledger, node: str) -> dict[tuple[str, int, str, int], int]:
    """(deployment, replica, node, GPU) -> the measured excess booked on `node` now."""
    return {(b.deployment, b.replica, b.node, b.index): b.footprint.observed_excess
            for key in ledger.deployments_on(node) for b in ledger.bookings_of(key)
            if b.node == node and b.footprint.observed_excess}


def apply(ledger: Ledger, ch: Change) -> list[GpuKey]:
    """THE change the agent's measurements make to the ledger: each changed deployment's bookings
    replaced (unchecked: what is really held is booked even when it over-runs the budget).
    Returns the GPUs it touched that are now over budget."""
    touched: set[GpuKey] = set()
    for key, bookings in sorted(ch.bookings.items()):
        touched |= {(b.node, b.index) for b in ledger.bookings_of(key)}
        ledger.restore(key, bookings)
        touched |= {(b.node, b.index) for b in bookings}
    return sorted(k for k in touched if ledger.headroom_bytes(*k) < 0)


def holders(ledger: Ledger, node: str, index: int) -> str:
    """One line: how far a GPU is over budget, and who holds what there."""
    slot = ledger.slot(node, index)
    budget = slot.budget_bytes if slot else 0
    over = -ledger.headroom_bytes(node, index)
    parts = []
    for b in ledger.bookings_on(node, index):
        fp = b.footprint
        how = (f"measured {fmt_gib(fp.total - defaults.OBSERVED_MARGIN_BYTES)} + margin, predicted "
               f"{fmt_gib(fp.predicted)}") if fp.observed_excess else "as predicted"
        parts.append(f"{b.deployment} replica {b.replica} holds {fmt_gib(fp.total)} ({how})")
    if slot and slot.foreign_bytes:
        parts.append(f"others (not vllmfit) hold {fmt_gib(slot.foreign_bytes)}")
    state = f"{fmt_gib(over)} over" if over > 0 else "within"
    return f"{node} GPU {index} is {state} its budget of {fmt_gib(budget)}: " + "; ".join(parts or ["nothing booked"])


@dataclass(frozen=True)
class Gate:
    """The start gate's verdict for one replica."""

    open: bool
    reason: str


def start_gate(
    ledger: Ledger,
    key: str,
    replica: int,
    free: Mapping[int, int] | None,
    age_s: float | None,
    started: Callable[[str, int], bool],
    in_use: Mapping[tuple[str, int, int], int] | None = None,
    max_age_s: float = defaults.START_GATE_MAX_AGE_SECONDS,
    made_for: str | None = None,
) -> Gate:
    """Whether replica `replica` of `key` may start (module docstring).

    `free`: GPU index -> free bytes (total - used) in the agent's latest inventory of the
    replica's node, None when the node has no inventory; `age_s`: its age (None: unreadable);
    `started(key, replica)`; `in_use`: (key, replica, GPU index) -> bytes its processes hold now;
    `made_for`: the "node:i,j" the pod was made for (a pod of a replica booked elsewhere since
    is never released: its Deployment's new pods are)."""
    mine = sorted(ledger.bookings_of(key, replica), key=lambda b: b.index)
    if not mine:
        return Gate(False, f"held: {key} replica {replica} is not booked")
    node, held = mine[0].node, in_use or {}
    where = f"{node}:{','.join(str(b.index) for b in mine)}"
    if made_for is not None and made_for != where:
        return Gate(False, f"held: this pod was made for {made_for}; the replica is booked on {where} now")
    if free is None:
        return Gate(True, f"node {node} publishes no agent inventory: released on its reservation alone")
    if age_s is None or age_s > max_age_s:
        age = "unreadable" if age_s is None else f"{int(age_s)} s old"
        return Gate(False, f"held: the agent's inventory of node {node} is {age} (more than {max_age_s:g} s); "
                           "waiting for a fresh one")
    for b in mine:
        f = free.get(b.index)
        if f is None:
            return Gate(False, f"held: the agent's inventory of node {node} does not list GPU {b.index}")
        own = max(0, b.footprint.total - held.get((key, replica, b.index), 0))
        others = sum(max(0, o.footprint.total - held.get((o.deployment, o.replica, b.index), 0))
                     for o in ledger.bookings_on(node, b.index)
                     if (o.deployment, o.replica) != (key, replica) and not started(o.deployment, o.replica))
        if f < own + others:
            beside = f" beside {fmt_gib(others)} booked by replicas not started yet" if others else ""
            return Gate(False, f"held: {node} GPU {b.index} has {fmt_gib(f)} free (agent), this replica needs "
                               f"{fmt_gib(own)}{beside}")
    return Gate(True, f"measured room on {node} GPU {', '.join(str(b.index) for b in mine)}")
