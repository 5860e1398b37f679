"""Decisions -> records: book or release in the ledger and update the records. Called inside a
`store.books.transaction()` (they change `store.books.writing`); no writes to the API (what must be written is collected in `Effects`)."""

from __future__ import annotations

import logging

from vllmfit.core import defaults, memory, placement
from vllmfit.core.placement import Decision, Request
from vllmfit.operator import metrics
from vllmfit.operator.admission import bounded
from vllmfit.operator.binding import enforcement
from vllmfit.operator.booking import changes, draining, pods, report
from vllmfit.operator.booking.record import Record
from vllmfit.operator.booking.report import now
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.children import children_state
from vllmfit.operator.handlers.common import Effects, Invalid, checked
from vllmfit.operator.rendering import builders
from vllmfit.sources.resolve import ModelResolutionError

logger = logging.getLogger(__name__)


def refresh_ready(rec: Record, t: str) -> None:
    """The Ready condition (and `failed`) from the pods seen so far."""
    if not rec.admitted:
        rec.failed = False
        health = pods.PodHealth(False, "NotAdmitted", f"not admitted ({rec.outcome})")
    elif not rec.placement:
        rec.failed = False
        health = pods.PodHealth(False, "ScaledToZero", "spec.replicas is 0")
    else:
        health = pods.summarize(rec.pods.values(), len(rec.placement))
        rec.failed = health.failed
    rec.conditions = report.set_condition(rec.conditions, "Ready", "True" if health.ready else "False",
                                            health.reason, health.message, t, rec.generation)


def not_admitted(rec: Record, phase: str, reason: str, message: str, fx: Effects, *,
                 reasons: tuple[str, ...] = (), suggestions: tuple[str, ...] = (), warnings: tuple[str, ...] = (),
                 t: str) -> None:
    """Record an outcome that books nothing. An admitted deployment keeps serving its admitted
    spec (nothing admitted is ever lost); the condition says the new spec is not applied."""
    rec.reasons, rec.suggestions = list(reasons or (message,)), list(suggestions)
    if rec.admitted:
        reason = f"Update{reason}"
        message = f"spec generation {rec.generation} is not applied; still serving the admitted spec: {message}"
        rec.conditions = report.set_condition(rec.conditions, "Admitted", "False", reason, message, t,
                                                rec.generation)
    else:
        rec.outcome, rec.placement, rec.flags, rec.warnings = phase, [], None, list(warnings)
        rec.conditions = report.set_condition(rec.conditions, "Admitted", "False" if phase != "Pending" else
                                                "Unknown", reason, message, t, rec.generation)
        rec.conditions = report.set_condition(rec.conditions, "Placed", "False", "NotPlaced", message, t,
                                                rec.generation)
        fx.sync.add(rec.key)  # delete Deployments it may have had
    rec.waiting = phase == "Unschedulable"
    if message != rec.last_event:
        fx.events.append((rec.body, "Warning", reason, message))
        rec.last_event = message
    metrics.ADMISSIONS.labels(phase).inc()


def scale_keep(ledger: placement.Ledger, rec: Record, req: Request) -> list[placement.ReplicaAllocation]:
    """When only spec.replicas changed (kubectl scale, an HPA), the replicas that stay keep their
    GPUs: a shrink releases the highest ones and always succeeds; a growth places only the new
    ones, and is admitted only if every new one fits. A change of nothing memory needs (env,
    resources, the pod template's tolerations...) keeps every replica where it is."""
    old = rec.admitted_request
    if not rec.admitted or old is None or rec.flags is None:
        return []
    if changes.memory_changes(old.spec, req.spec) not in ([], ["replicas"]):
        return []  # a change of what a replica needs or where it may run: decided afresh
    below = min(old.spec.replicas, req.spec.replicas)
    return placement.held_replicas(ledger, rec.key, below, rec.flags)


def apply_decision(store: Store, rec: Record, req: Request, d: Decision, fx: Effects, *, cause: str = "") -> None:
    """Book an admitted decision, or record why not."""
    ledger, key, t = store.books.writing, rec.key, now()
    before = builders.gpus_of(ledger, key)
    rec.observed_generation = rec.generation
    rec.request = req
    if d.admitted:
        old, old_flags = [builders.placement_text(p) for p in rec.placement], rec.flags
        old_by = {p.replica: builders.placement_text(p) for p in rec.placement}
        stopping = ledger.bookings_of(key)
        ledger.book(d)
        draining.revive(ledger, store.books.drains, key)
        draining.hold(ledger, store.books.drains, key, stopping)  # what leaves stays booked until its pods are gone
        rec.admitted, rec.outcome, rec.waiting = True, "Admitted", False
        rec.allocation_failure = ""  # a new placement: a new claim the scheduler may fail to allocate
        rec.admitted_request = req
        rec.placement = report.placement_from(d, ledger)
        rec.flags = d.flags
        rec.kv_cache = report.kv_status(d)
        rec.vllm_version = memory.parse_version(req.spec.vllm_version or req.spec.image)[0].label
        # layer types the memory model does not know: a condition while they last (spec.strict refuses)
        rec.conditions = [c for c in rec.conditions if c.type != "ModelUnderstood"]
        if req.model.warnings:
            rec.conditions = report.set_condition(rec.conditions, "ModelUnderstood", "False", "UnknownLayerType",
                                                    "; ".join(req.model.warnings), t, rec.generation)
        rec.reasons, rec.suggestions, rec.warnings = [], [], list(d.warnings)
        new = [builders.placement_text(p) for p in rec.placement]
        new_by = {p.replica: builders.placement_text(p) for p in rec.placement}
        moved = any(new_by[r] != text for r, text in old_by.items() if r in new_by)  # a scale moves nothing
        scaled = bool(old) and len(old) != len(new) and not moved
        where = "; ".join(f"replica {p.replica}: {builders.placement_text(p)}" for p in rec.placement) or "no replicas"
        rec.conditions = report.set_condition(rec.conditions, "Admitted", "True", "Admitted", d.message, t,
                                                rec.generation)
        rec.conditions = report.set_condition(rec.conditions, "Placed", "True",
                                                "Moved" if moved or d.moved else "Placed", where, t, rec.generation)
        # how its Deployments will be bound, in the status that books it (no second status write),
        # and in this decision's Event: a replica that runs without enforcement makes it a Warning
        bare = None
        if (modes := enforcement.first_modes(store, rec, ledger)) is not None:
            bare = enforcement.said(store, rec, modes, post=False)
        if bare:
            metrics.not_enforced(key)
        kind, tail = ("Warning", f"; {bare}") if bare else ("Normal", "")
        message = d.message + (f"; warnings: {'; '.join(d.warnings)}" if d.warnings else "")
        if moved:
            message = f"moved from {', '.join(old)} to {', '.join(new)}" + (f" ({cause})" if cause else "")
            fx.events.append((rec.body, "Warning", "Moved", message + tail))
        elif scaled:
            message = f"scaled from {len(old)} to {len(new)} replicas: {where}"
            fx.events.append((rec.body, kind, "Scaled", message + tail))
        elif old and cause and rec.flags != old_flags:
            message = (f"resized on {', '.join(new)} ({cause}): --max-model-len {old_flags and old_flags.max_model_len}"
                       f" -> {rec.flags and rec.flags.max_model_len}")
            fx.events.append((rec.body, "Warning", "Resized", message + tail))
        elif message != rec.last_event or bare:
            fx.events.append((rec.body, kind, "Admitted", message + tail))
        rec.last_event = message
        fx.sync.add(key)
        metrics.ADMISSIONS.labels("Admitted").inc()
    else:
        message = f"{cause}: {d.message}" if cause else d.message
        not_admitted(rec, d.phase, d.phase, message, fx, reasons=d.reasons, suggestions=d.suggestions,
                     warnings=d.warnings, t=t)
    refresh_ready(rec, t)
    fx.mark.update({key} | builders.neighbours(ledger, before | builders.gpus_of(ledger, key)))


async def retry_waiting(store: Store, fx: Effects) -> None:
    """After room freed up: decide again, in creation order, every spec waiting for room (each
    decision bounded in time, off the event loop; the caller holds the lock). One that still
    does not fit keeps waiting, with the reasons of now (its old ones may name no node at all)."""
    for rec in sorted((r for r in store.cache.records.values() if r.waiting and r.request), key=lambda r: r.order):
        assert rec.request is not None
        d = await bounded.decide(store.workers, store.books.ledger, rec.request)
        if d.admitted:
            apply_decision(store, rec, rec.request, d, fx, cause="room freed up")
        elif d.phase == "Unschedulable" and list(d.reasons or (d.message,)) != rec.reasons:
            apply_decision(store, rec, rec.request, d, fx)


async def replan(store: Store, node: str, fx: Effects, cause: str) -> None:
    """Restore the invariant after `node` lost GPUs or room (placement.replan: only what must
    move moves, the newest first, keeping its flags). A deployment that fits nowhere any more is
    released whole and becomes Unschedulable (its Deployments are deleted; it waits for room).

    Re-placing is a search per evicted deployment, so it runs like every decision: off the event
    loop, on a copy of the ledger, within DECIDE_TIMEOUT_S (the copy becomes the ledger when it
    ends in time; the caller holds the lock, so nothing else changed it meanwhile). Past the
    limit the worker is abandoned with its copy, and the cheap part runs here instead: the
    evictions only (linear in the bookings), each evicted deployment waiting for room, to be
    decided again, bounded, by retry_waiting. Either way no GPU stays over budget."""
    before = {k: builders.gpus_of(store.books.ledger, k) for k in store.books.ledger.deployments()}
    held = {k: store.books.ledger.bookings_of(k) for k in store.books.ledger.deployments() if not draining.is_drain(k)}
    requests = {k: r.request or r.admitted_request for k, r in store.cache.records.items() if k in before}
    known = {k: v for k, v in requests.items() if v is not None}
    flags = {k: r.flags for k, r in store.cache.records.items() if k in before and r.flags}
    work = store.books.ledger.fork()  # the next version, built apart (the abandoned worker keeps its own)
    try:
        result = await bounded.run(store.workers, placement.replan, work, known, flags=flags, timeout=defaults.DECIDE_TIMEOUT_S)
        store.books.replace(work)  # the transaction's result from here on (committed with it, or dropped)
    except bounded.TooCostly:
        why = (f"re-placing it took more than {defaults.DECIDE_TIMEOUT_S:g} s, so it waits for room "
               "and is decided again when room frees up")
        logger.warning("%s: %s", cause, why)
        result = placement.replan(store.books.writing, known, flags=flags, place=False, why_not_placed=why)
    ledger = store.books.writing
    for key in result.evicted:
        rec = store.cache.records.get(key)
        fx.mark.update(builders.neighbours(ledger, before.get(key, set())))
        if draining.is_drain(key):
            continue  # a stopped replica's pods still hold it: charged again below
        if rec is None:
            ledger.release(key)
            continue
        req = requests.get(key)
        if key in result.moves and req is not None:
            apply_decision(store, rec, req, result.moves[key], fx, cause=cause)
            draining.hold(ledger, store.books.drains, key, held.get(key, []))
            continue
        ledger.release(key)  # all or nothing: its remaining replicas go too
        draining.hold(ledger, store.books.drains, key, held.get(key, []))
        rec.admitted = False
        d = result.waiting.get(key) or Decision(key, "Unschedulable", message="the model is not resolved yet")
        if req is None:
            not_admitted(rec, "Unschedulable", "Unschedulable", f"{cause}: {d.message}", fx, t=now())
            refresh_ready(rec, now())
            fx.mark.add(key)
        else:
            apply_decision(store, rec, req, d, fx, cause=cause)
    for d in store.books.drains.values():  # drains the re-planning took out: their pods still hold them
        if not ledger.bookings_of(d.name):
            draining.charge(ledger, d)


async def resolve_requests_on(store: Store, nodes: set[str]) -> None:
    """Re-placing needs resolved models: resolve the request of every deployment booked on these
    nodes (before the caller takes the lock; a spec that cannot be resolved keeps none)."""
    keys = {k for n in nodes for k in store.books.ledger.deployments_on(n)}  # not a pass over all (issue 32)
    for key in sorted(keys):
        rec = store.cache.records.get(key)
        if rec is not None and rec.request is None:
            try:
                rec.request = await store.request_for(await checked(store, rec.body))
            except (Invalid, ModelResolutionError):
                pass


async def update_node(store: Store, name: str, info: placement.NodeInfo | None, fx: Effects, gone: str) -> None:
    """Put a node's GPUs into the ledger (hold the lock): move what no longer fits, give waiting
    specs a chance when room grew; rewrite the children whose GPU binding changed (a node moved
    from the device plugin to DRA)."""
    old = store.books.ledger.nodes.get(name)
    store.cache.pins_dirty.add(name)  # its GPUs' UUIDs (pins) may change
    placed = set(store.books.ledger.deployments_on(name))  # before the change (a node removed books none after)
    if info != old:
        slots = [(s.node, s.index) for s in (old.gpus if old else ())]
        before = {k: store.books.ledger.headroom_bytes(*k) for k in slots}
        if info is None:
            store.books.writing.remove_node(name)
            cause = f"node {name} {gone}"
        else:
            store.books.writing.set_node(info)
            cause = f"node {name} changed ({', '.join(info.warnings) or 'capacity, labels or foreign use'})"
        await replan(store, name, fx, cause)
        grew = info is not None and (old is None or any(
            store.books.ledger.headroom_bytes(s.node, s.index) > before.get((s.node, s.index), 0) for s in info.gpus))
        if grew:
            await retry_waiting(store, fx)
        fx.mark.update(builders.neighbours(store.books.ledger, {(s.node, s.index) for s in info.gpus} if info else set()))
    for k in sorted(placed | set(store.books.ledger.deployments_on(name))):  # the node's, not every record (issue 32)
        rec = store.cache.records.get(k)
        if rec is not None and rec.admitted and rec.synced is not None and any(p.node == name for p in rec.placement) \
                and rec.synced != children_state(store, rec):
            fx.sync.add(k)
