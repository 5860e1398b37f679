"""Nodes: their GPUs (GFD labels, the agent's inventory) into the ledger, refused node data,
and the memory observed per deployment (attribution)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic

from vllmfit.core import defaults, memory, placement
from vllmfit.core.observe import attribution, inventory
from vllmfit.core.placement import observed
from vllmfit.core.spec import api
from vllmfit.operator import metrics
from vllmfit.operator.admission import bounded
from vllmfit.operator.binding import reservations
from vllmfit.operator.booking import learning, report
from vllmfit.operator.booking.measured import forget, in_use, ready, started
from vllmfit.operator.booking.record import OVER_BUDGET
from vllmfit.operator.booking.report import now
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.common import Effects, store_of
from vllmfit.operator.handlers.decide import apply_decision, resolve_requests_on, retry_waiting, update_node
from vllmfit.operator.handlers.writes import finish
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

logger = logging.getLogger(__name__)


def node_info(body: Mapping[str, Any], pods: Mapping[str, str] | None = None,
              previous: placement.NodeInfo | None = None, *,
              policy: memory.BudgetPolicy = memory.DEFAULT_POLICY) -> placement.NodeInfo | None:
    """The node's GPUs, or None when it has none (no GFD labels, no inventory). `pods` maps the
    UIDs of vllmfit's pods to their deployment (their memory is booked, not foreign). Raises
    placement.NodeDataError (a LookupError) when its GPU labels or inventory are refused
    (malformed, out of range, not believable): the caller keeps `previous`, never evicts.
    `policy`: the operator's budget policy (--budget-*, Options.budget)."""
    read = placement.read_node(body, catalog.gpu_for_label, pods, now=datetime.now(UTC), previous=previous,
                              policy=policy)
    if read.problem:
        raise placement.NodeDataError(read.problem)
    return read.info


def attribute(store: Store, node: str, body: Mapping[str, Any], t: str) -> None:
    """Observed memory per deployment from the agent's inventory (status.observed, MemoryDrift)."""
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(defaults.INVENTORY_ANNOTATION)
    if not raw:
        store.cache.attributions.pop(node, None)
        store.cache.replica_usage.pop(node, None)
        return
    try:
        inv = inventory.GpuInventory.model_validate_json(raw)
    except pydantic.ValidationError:
        return
    att = attribution.attribute(inv, store.cache.managed_pods(written=False))
    store.cache.attributions[node] = att
    store.cache.replica_usage[node] = attribution.attribute(inv, store.cache.managed_pods(replica=True))  # the closed loop's view
    for key in store.books.ledger.deployments_on(node):  # the node's, not every deployment's (issue 32)
        rec = store.cache.records.get(key)
        mine = [b for b in store.books.ledger.bookings_of(key) if b.node == node]
        if rec is None or not mine:
            continue
        entries, warn = [], []
        for b in mine:
            unit = att.units.get(b.index)
            if unit is None or not unit.attributable or b.index not in att.by_deployment.get(key, {}):
                continue  # nothing measured for it there (not running yet, or processes not listed)
            seen = att.observed(key, b.index)
            drift, bad = attribution.drift(b.footprint.predicted, seen)
            entries.append(api.ObservedMemory(node=node, index=b.index, used_bytes=seen,
                                              predicted_bytes=b.footprint.predicted, drift_bytes=drift,
                                              sampled_at=att.sampled_at))
            if bad:
                warn.append(f"{node} GPU {b.index}: uses {memory.fmt_gib(seen)}, predicted "
                            f"{memory.fmt_gib(b.footprint.predicted)}")
        rec.observed = [o for o in rec.observed if o.node != node] + entries
        if entries or warn:
            rec.conditions = report.set_condition(
                rec.conditions, "MemoryDrift", "True" if warn else "False",
                "AbovePrediction" if warn else "WithinPrediction",
                "; ".join(warn) or "observed GPU memory is within the prediction", t, rec.generation)
        store.writer.mark([key])


async def on_node(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Capacity, labels, the agent's inventory, or the node itself changed: update the ledger,
    move what no longer fits, give waiting specs a chance when room grew."""
    store = store_of(memo)
    await store.books.ready.wait()
    name = (body.get("metadata") or {}).get("name") or ""
    try:
        info = None if type == "DELETED" else node_info(body, store.cache.managed_pods(), store.books.ledger.nodes.get(name),
                                                      policy=store.options.budget)
    except placement.NodeDataError as e:
        await node_data_refused(store, name, str(e).splitlines()[0])
        return
    except (LookupError, pydantic.ValidationError) as e:
        logger.warning("node %s: GPU information unreadable, keeping what was known: %s", name,
                       str(e).splitlines()[0])
        return
    await resolve_requests_on(store, {name})
    fx, t = Effects(), now()
    async with store.books.changing():
        if type == "DELETED":
            store.cache.node_infos.pop(name, None)
        else:
            store.cache.node_infos[name] = info
            store.books.refused.discard(name)
            info = store.effective_node(name, info)
        # a re-plan for a change of the node itself (capacity, foreign use) decides on the
        # predictions: a measurement never moves a started replica (docs/operator.md); the
        # measured bookings are put back right after, from this inventory
        held = observed.kept(store.books.ledger, name)
        observed.apply(store.books.writing, observed.floor(store.books.ledger, name))  # the ledger's measured change, 1 of 2
        await update_node(store, name, info, fx, "was removed" if type == "DELETED" else "no longer reports GPUs")
        if info is not None:
            attribute(store, name, body, t)
            shrank = close_loop(store, name, fx, held)
            await after_measuring(store, name, shrank, fx, t)
        node_data_condition(store, name, None, fx, t)
    await finish(store, fx, strict=False)
    await learning.save(store)
    if reservations.device_plugin(store, name):
        await reservations.ungate(store)  # measured room may have grown: the start gate looks again


NODE_DATA = "NodeData"
"""Condition on the deployments of a node whose GPU labels or inventory were refused."""


async def node_data_refused(store: Store, name: str, problem: str) -> None:
    """A node's GPU labels or inventory were refused (core.placement.read_node): the node keeps
    its last good state; say so with a metric, and a condition and an Event on its deployments."""
    logger.warning("node %s: GPU information refused, keeping what was known: %s", name, problem)
    metrics.NODE_DATA_REFUSED.labels(name).inc()
    fx, t = Effects(), now()
    async with store.books.changing():
        node_data_condition(store, name, problem, fx, t)
    await finish(store, fx, strict=False)


def node_data_condition(store: Store, name: str, problem: str | None, fx: Effects, t: str) -> None:
    """Set (problem) or clear (None) the NodeData condition of the deployments booked on `name`;
    an Event when it turns False or its message changes. Hold the lock."""
    for key in sorted(store.books.ledger.deployments_on(name)):
        rec = store.cache.records.get(key)
        if rec is None:
            continue
        old = next((c for c in rec.conditions if c.type == NODE_DATA), None)
        if problem is None:
            if old is None or old.status == "True":
                continue
            rec.conditions = report.set_condition(rec.conditions, NODE_DATA, "True", "NodeDataValid",
                                                  f"node {name} reports readable GPU information again", t,
                                                  rec.generation)
        else:
            message = f"{problem}; node {name} keeps its last good state, nothing on it is moved"
            if old is not None and old.status == "False" and old.message == message:
                continue
            rec.conditions = report.set_condition(rec.conditions, NODE_DATA, "False", "NodeDataRefused", message,
                                                  t, rec.generation)
            fx.events.append((rec.body, "Warning", "NodeDataRefused", message))
        fx.mark.add(key)


# --- The closed loop (issue 34): measured footprints into the ledger ---------------------------


def close_loop(store: Store, node: str, fx: Effects, held: dict[tuple[str, int, str, int], int]) -> bool:
    """The node's latest inventory, per replica: footprints seen stable start their replica and
    teach a learned record; started replicas' bookings become max(prediction, observed + margin)
    (observed.apply, the one change the measurements make to the ledger); what this inventory does
    not measure again keeps the excess it had (`held`, observed.kept before observed.floor).
    Returns whether a measured booking came back down. Hold the lock."""
    att = store.cache.replica_usage.get(node)
    measured = []
    fresh: set[tuple[str, int]] = set()  # replicas whose start ends with this report: they teach
    if att is not None:
        forget(store, node)
        for (key, replica, index), n in sorted(in_use(store, node).items()):
            if not att.units[index].attributable:
                continue
            sample = (att.sampled_at, n)
            samples = store.cache.footprints.setdefault(node, {})
            prev = samples.get((key, replica, index))
            samples[(key, replica, index)] = sample
            if (observed.stable(prev, sample) or ready(store, key, replica)) and (key, replica) not in store.cache.started:
                store.cache.started.add((key, replica))
                fresh.add((key, replica))
            measured.append(observed.Measured(key, replica, node, index, n, started(store, key, replica)))
        teach(store, node, [m for m in measured if (m.deployment, m.replica) in fresh], fx)
    change = observed.change(store.books.ledger, measured, kept=held)
    before = {k: builders.gpus_of(store.books.ledger, k) for k in change.bookings}
    observed.apply(store.books.writing, change)  # the ledger's measured change, 2 of 2
    for g in change.grown:
        rec = store.cache.records.get(g.deployment)
        if rec is None:
            continue
        fx.mark.update({g.deployment} | builders.neighbours(store.books.ledger, before.get(g.deployment, set())))
        if g.after > g.before:
            text = (f"{g.node} GPU {g.index} replica {g.replica}: measured {memory.fmt_gib(g.observed)}, "
                    f"predicted {memory.fmt_gib(g.predicted)}; booked {memory.fmt_gib(g.before)} -> "
                    f"{memory.fmt_gib(g.after)}")
            fx.events.append((rec.body, "Warning", "BookingGrew", text))
    return any(g.after < g.before for g in change.grown)


async def after_measuring(store: Store, node: str, shrank: bool, fx: Effects, t: str) -> None:
    """Over budget (conditions, Events, re-placing what has not started), and room for waiting
    specs when a measured booking came back down. Hold the lock."""
    await over_budget(store, node, fx, t)
    if shrank:
        await retry_waiting(store, fx)  # a booking came back down: room for what waits


OVERRUN = "Overrun"
"""A replica used more at its start than a start may teach (memory.learned.overrun_bound)."""


def teach(store: Store, node: str, measured: list[observed.Measured], fx: Effects) -> None:
    """A replica's start (the footprint it settled at) teaches a learned record of its configuration,
    kept for its namespace (cluster-wide in the operator's own); an over-run beyond the bound flags the
    deployment (Event) and teaches nothing."""
    for m in measured:
        rec = store.cache.records.get(m.deployment)
        req = rec and (rec.request or rec.admitted_request)
        slot = store.books.ledger.slot(node, m.index)
        mine = [b for b in store.books.ledger.bookings_of(m.deployment, m.replica) if b.node == node and b.index == m.index]
        if rec is None or req is None or slot is None or not mine:
            continue
        s = placement.settings_from_spec(req.spec)
        fp = mine[0].footprint
        predicted = fp.predicted - fp.learned  # the memory model's own figure, not an earlier correction
        source = f"{m.deployment} replica {m.replica} on {node} GPU {m.index}"
        if m.used_bytes - predicted > (bound := memory.learned.overrun_bound(predicted)):
            text = (f"{source} used {memory.fmt_gib(m.used_bytes)} at its start, "
                    f"{memory.fmt_gib(m.used_bytes - predicted)} over the predicted {memory.fmt_gib(predicted)}: beyond "
                    f"the {memory.fmt_gib(bound)} a start may teach, so this deployment is flagged and its "
                    "configuration keeps its prediction for everyone else")
            rec.conditions = report.set_condition(rec.conditions, OVERRUN, "True", "OverrunNotLearned", text, now(),
                                                  rec.generation)
            fx.events.append((rec.body, "Warning", "OverrunNotLearned", text))
            fx.mark.add(m.deployment)
            continue
        ns = "" if rec.namespace == learning.namespace(store) else rec.namespace
        at = int(datetime.now(UTC).timestamp())
        new = memory.learned.record(req.model.name, slot.gpu.product, s, predicted, m.used_bytes, source,
                                    namespace=ns, learned_at=at)
        merged = memory.learned.learn(memory.learned.current(store.cache.learned, at), new)
        if merged != store.cache.learned:
            store.cache.learned = merged
            store.cache.learned_dirty = True  # written by learning.save after the handler's writes


async def over_budget(store: Store, node: str, fx: Effects, t: str) -> None:
    """Deployments booked on a GPU of `node` over budget that have not started anywhere are decided
    again (they go elsewhere when they fit elsewhere; else they stay, behind the start gate); then
    a condition and an Event naming who holds what on each GPU still over budget, cleared once
    back within budget."""
    info = store.books.ledger.nodes.get(node)  # its slots, not a sort of the fleet's (issue 32)
    slots = {(node, s.index) for s in info.gpus} if info is not None else set()
    bad = {k for k in slots if store.books.ledger.headroom_bytes(*k) < 0}
    for key in sorted({b.deployment for k in sorted(bad) for b in store.books.ledger.bookings_on(*k)}):
        rec = store.cache.records.get(key)
        if rec is None or not rec.admitted or any(started(store, key, p.replica) for p in rec.placement):
            continue
        req = rec.request or rec.admitted_request
        if req is None:
            continue
        without = store.books.ledger.fork()  # decided on a copy without it; the writer's ledger unchanged meanwhile
        without.release(key)
        d = await bounded.decide(store.workers, without, req)
        if d.admitted and not {(b.node, b.index) for b in d.bookings()} & bad:  # applied in one step
            store.books.writing.release(key)
            apply_decision(store, rec, req, d, fx, cause=f"{node}: a GPU it was booked on is over budget (measured)")
        # else nowhere better: it stays, behind the start gate
    # The condition of what is booked here, and of what said it was over budget (it may be booked
    # elsewhere now), from every GPU it is booked on: another node's report leaves it as it is
    # (it was cleared, then set again with an Event, by each report of any other node), and a
    # report looks at the node's deployments, not at every record (issue 32).
    ledger, over = store.books.ledger, store.cache.over_budget
    for key in sorted(set(ledger.deployments_on(node)) | over):
        rec = store.cache.records.get(key)
        if rec is None:
            over.discard(key)
            continue
        gpus = sorted({(b.node, b.index) for b in ledger.bookings_of(key)})
        lines = [observed.holders(ledger, *k) for k in gpus if ledger.headroom_bytes(*k) < 0]
        old = next((c for c in rec.conditions if c.type == OVER_BUDGET), None)
        if lines:
            over.add(key)
            message = "; ".join(lines)
            if old is None or old.status != "True" or old.message != message:
                rec.conditions = report.set_condition(rec.conditions, OVER_BUDGET, "True", "MeasuredOverBudget",
                                                      message, t, rec.generation)
                fx.events.append((rec.body, "Warning", "GpuOverBudget", message))
                fx.mark.add(key)
        else:
            over.discard(key)
            if old is not None and old.status == "True":
                rec.conditions = report.set_condition(rec.conditions, OVER_BUDGET, "False", "WithinBudget",
                                                      "every GPU it is booked on is within its budget", t,
                                                      rec.generation)
                fx.mark.add(key)
