"""The Kopf handlers: a thin shell around placement.decide, the Store and the builders.

Every handler follows the same shape:
  1. outside the lock: parse the object, resolve its model (may call the Hub);
  2. under `store.lock`: decide and book or release, update the records (no I/O, no awaits);
  3. outside the lock: post Events, write the children (Deployments, Service), mark statuses.
Step 2 collects what step 3 must do in `Effects`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiException

from vllmfit.backends import binding, dra
from vllmfit.backends import reservation as rsv
from vllmfit.core import defaults, errors, memory, placement
from vllmfit.core.observe import attribution, inventory
from vllmfit.core.placement import Decision, Request
from vllmfit.core.spec import api
from vllmfit.operator import bounded, builders, claims, metrics, pods, report, reservations, webhook
from vllmfit.operator.record import ModelResolutionError, Record, key_of
from vllmfit.operator.state import Store, get_store
from vllmfit.sources import catalog

logger = logging.getLogger(__name__)

RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
SETTLING = ("Starting", "Pending", "Terminating", "NotAdmitted", "ScaledToZero")


class Invalid(ValueError):
    """The object cannot be used as it is (message: one line naming the field)."""


@dataclass
class Effects:
    """What to do after the lock is released."""

    events: list[tuple[dict[str, Any], str, str, str]] = field(default_factory=list)  # body, type, reason, message
    sync: set[str] = field(default_factory=set)  # keys whose Deployments/Service to write or delete
    mark: set[str] = field(default_factory=set)  # keys whose status to write


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse(body: Mapping[str, Any]) -> api.VLLMDeployment:
    try:
        obj = api.VLLMDeployment.model_validate({"metadata": body.get("metadata") or {}, "spec": body.get("spec") or {}})
    except pydantic.ValidationError as e:
        raise Invalid(errors.one_line(e)) from None
    problems = builders.spec_problems(obj)
    if problems:
        raise Invalid("; ".join(problems))
    return obj


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    try:
        kopf.event(dict(body), type=type_, reason=reason, message=message[:1000])  # type: ignore[arg-type]
    except LookupError:  # not inside a running operator (handler logic called directly)
        logger.info("event %s %s: %s", type_, reason, message)


# --- Decisions -> records (called under the lock; no awaits) -----------------------------------


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


def scale_keep(store: Store, rec: Record, req: Request) -> list[placement.ReplicaAllocation]:
    """When only spec.replicas changed (kubectl scale, an HPA), the replicas that stay keep their
    GPUs: a shrink releases the highest ones and always succeeds; a growth places only the new
    ones, and is admitted only if every new one fits. A change of nothing memory needs (env,
    resources, the pod template's tolerations...) keeps every replica where it is."""
    old = rec.admitted_request
    if not rec.admitted or old is None or rec.flags is None:
        return []
    if webhook.memory_changes(old.spec, req.spec) not in ([], ["replicas"]):
        return []  # a change of what a replica needs or where it may run: decided afresh
    below = min(old.spec.replicas, req.spec.replicas)
    return placement.held_replicas(store.ledger, rec.key, below, builders.to_memory_flags(rec.flags))


def apply_decision(store: Store, rec: Record, req: Request, d: Decision, fx: Effects, *, cause: str = "") -> None:
    """Book an admitted decision, or record why not."""
    ledger, key, t = store.ledger, rec.key, now()
    before = builders.gpus_of(ledger, key)
    rec.observed_generation = rec.generation
    rec.request = req
    if d.admitted:
        old, old_flags = [builders.placement_text(p) for p in rec.placement], rec.flags
        old_by = {p.replica: builders.placement_text(p) for p in rec.placement}
        ledger.book(d)
        rec.admitted, rec.outcome, rec.waiting = True, "Admitted", False
        rec.allocation_failure = ""  # a new placement: a new claim the scheduler may fail to allocate
        rec.admitted_request = req
        rec.placement = report.placement_from(d, ledger)
        rec.flags = report.api_flags(d.flags)
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
        message = d.message + (f"; warnings: {'; '.join(d.warnings)}" if d.warnings else "")
        if moved:
            message = f"moved from {', '.join(old)} to {', '.join(new)}" + (f" ({cause})" if cause else "")
            fx.events.append((rec.body, "Warning", "Moved", message))
        elif scaled:
            message = f"scaled from {len(old)} to {len(new)} replicas: {where}"
            fx.events.append((rec.body, "Normal", "Scaled", message))
        elif old and cause and rec.flags != old_flags:
            message = (f"resized on {', '.join(new)} ({cause}): --max-model-len {old_flags and old_flags.max_model_len}"
                       f" -> {rec.flags and rec.flags.max_model_len}")
            fx.events.append((rec.body, "Warning", "Resized", message))
        elif message != rec.last_event:
            fx.events.append((rec.body, "Normal", "Admitted", message))
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
    for rec in sorted((r for r in store.records.values() if r.waiting and r.request), key=lambda r: r.order):
        assert rec.request is not None
        d = await bounded.decide(store.ledger, rec.request)
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
    before = {k: builders.gpus_of(store.ledger, k) for k in store.ledger.deployments()}
    requests = {k: r.request or r.admitted_request for k, r in store.records.items() if k in before}
    known = {k: v for k, v in requests.items() if v is not None}
    flags = {k: builders.to_memory_flags(r.flags) for k, r in store.records.items() if k in before and r.flags}
    work = store.ledger.copy()
    try:
        result = await bounded.run(placement.replan, work, known, flags=flags, timeout=defaults.DECIDE_TIMEOUT_S)
        store.ledger = work
    except bounded.TooCostly:
        why = (f"re-placing it took more than {defaults.DECIDE_TIMEOUT_S:g} s, so it waits for room "
               "and is decided again when room frees up")
        logger.warning("%s: %s", cause, why)
        result = placement.replan(store.ledger, known, flags=flags, place=False, why_not_placed=why)
    ledger = store.ledger
    for key in result.evicted:
        rec = store.records.get(key)
        fx.mark.update(builders.neighbours(ledger, before.get(key, set())))
        if rec is None:
            ledger.release(key)
            continue
        req = requests.get(key)
        if key in result.moves and req is not None:
            apply_decision(store, rec, req, result.moves[key], fx, cause=cause)
            continue
        ledger.release(key)  # all or nothing: its remaining replicas go too
        rec.admitted = False
        d = result.waiting.get(key) or Decision(key, "Unschedulable", message="the model is not resolved yet")
        if req is None:
            not_admitted(rec, "Unschedulable", "Unschedulable", f"{cause}: {d.message}", fx, t=now())
            refresh_ready(rec, now())
            fx.mark.add(key)
        else:
            apply_decision(store, rec, req, d, fx, cause=cause)


# --- Writing -----------------------------------------------------------------------------------


async def apply_deployment(apps: client.AppsV1Api, make: Callable[[bool], dict[str, Any]], exclusive: bool,
                           owner: Mapping[str, Any]) -> bool:
    """Create the Deployment, or on 409 replace its spec (JSON Patch: KMock has no PUT). A
    replica whose placement did not change keeps its GPU pinning mode (switching would restart it).
    Returns whether it is pinned with device-plugin limits."""
    manifest = make(exclusive)
    kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
    meta = manifest["metadata"]
    try:
        await apps.create_namespaced_deployment(meta["namespace"], manifest)  # type: ignore[arg-type]
        return exclusive
    except ApiException as e:
        if e.status != 409:
            raise
    existing = await apps.read_namespaced_deployment(meta["name"], meta["namespace"])
    annotations = (existing.metadata.annotations or {}) if existing.metadata else {}
    same_place = annotations.get(builders.ANNOTATION_PLACEMENT) == meta["annotations"][builders.ANNOTATION_PLACEMENT]
    was_exclusive = annotations.get(builders.ANNOTATION_PINNING) == binding.PIN_DEVICE_PLUGIN
    if same_place and was_exclusive != exclusive:
        manifest = make(was_exclusive)
        kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
        meta = manifest["metadata"]
        exclusive = was_exclusive
    tpl = manifest["spec"]["template"]
    old_tpl = existing.spec.template if existing.spec else None
    if same_place and old_tpl is not None and old_tpl.spec is not None and not old_tpl.spec.scheduling_gates \
            and tpl["spec"].get("schedulingGates"):
        # a running replica is not restarted to add the reservation gate: its GPUs get their
        # reservations all the same (a neighbour holding the whole node with limits left)
        tpl["spec"]["schedulingGates"] = [g for g in tpl["spec"]["schedulingGates"] if g.get("name") != rsv.GATE] \
            or None
        if tpl["spec"]["schedulingGates"] is None:
            del tpl["spec"]["schedulingGates"]
        tpl["metadata"]["annotations"].pop(rsv.ANNOTATION_PINS, None)
    patch = [{"op": "add", "path": f"/metadata/{k}", "value": meta[k]}
             for k in ("labels", "annotations", "ownerReferences")]
    patch.append({"op": "add", "path": "/spec", "value": manifest["spec"]})
    await apps.patch_namespaced_deployment(meta["name"], meta["namespace"], patch,
                                           _content_type=JSON_PATCH)  # type: ignore[call-arg]
    return exclusive


async def apply_service(core: client.CoreV1Api, manifest: dict[str, Any], owner: Mapping[str, Any]) -> None:
    kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
    meta = manifest["metadata"]
    try:
        await core.create_namespaced_service(meta["namespace"], manifest)  # type: ignore[arg-type]
    except ApiException as e:
        if e.status != 409:
            raise
        patch = {"metadata": {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]},
                 "spec": {"selector": manifest["spec"]["selector"], "ports": manifest["spec"]["ports"]}}
        await core.patch_namespaced_service(meta["name"], meta["namespace"], patch,
                                            _content_type=MERGE_PATCH)  # type: ignore[call-arg]


def children_state(rec: Record) -> tuple[Any, ...]:
    """What the children of `rec` are built from (to skip rewriting them unchanged)."""
    req = rec.admitted_request
    store = get_store()
    # the gate is not part of it: a running replica is not restarted to add one (its GPUs get
    # their reservations all the same)
    pinning = tuple((tuple(reservations.pins(store, rec.key, p) or ()),
                     ((claims.desired(store, rec.key, p) or {}).get("metadata") or {}).get("name"),
                     store.backend_of(p.node))
                    for p in rec.placement)
    return (rec.admitted and not rec.going, tuple(builders.placement_text(p) for p in rec.placement), rec.flags,
            req.spec if req else None, req.model.name if req else None, pinning)


async def sync_children(store: Store, key: str) -> None:
    """Make the Deployments and the Service of `key` match its record (now, not when marked)."""
    async with store.child_locks[key]:
        rec = store.records.get(key)
        if rec is None:
            return
        state = children_state(rec)
        if rec.synced == state:
            return  # written by a concurrent call meanwhile
        apps, core = client.AppsV1Api(store.api), client.CoreV1Api(store.api)
        want: set[int] = set()
        if rec.admitted and not rec.going:
            req = rec.admitted_request
            if req is None or rec.flags is None:
                return  # restored with an update pending: its admitted spec is unknown; leave them
            obj = api.VLLMDeployment(metadata=api.ObjectMeta.model_validate(rec.body["metadata"]), spec=req.spec)
            flags = rec.flags
            for p in rec.placement:
                want.add(p.replica)
                tmpl: str | None = None
                if store.backend_of(p.node) == "dra":
                    tmpl = await claim_template(store, rec, p)
                    if tmpl is None:
                        continue  # no template it can use: its Deployment is not written (condition, Event)
                ex = builders.exclusive(store.ledger, key, p.node, [g.index for g in p.gpus]) and not tmpl
                pins, gated = reservations.pins(store, key, p), reservations.gated(store, key, p)

                weights = sum(b.footprint.weights for b in store.ledger.bookings_of(key) if b.replica == p.replica)

                def make(exclusive: bool, p: api.ReplicaPlacement = p, weights: int = weights,
                         pins: list[str] | None = pins, gated: bool = gated, tmpl: str | None = tmpl) -> dict[str, Any]:
                    return builders.deployment(obj, p, flags, req.model.name, exclusive=exclusive and not tmpl,
                                               weights_bytes=weights, pins=pins, gated=gated and not exclusive,
                                               claim_template=tmpl)

                if await apply_deployment(apps, make, ex, rec.body) and not tmpl:
                    store.whole[(key, p.replica)] = p.node
                else:
                    store.whole.pop((key, p.replica), None)
                store.written.add((key, p.replica))
                old = store.templates.get((key, p.replica))
                if tmpl:
                    store.templates[(key, p.replica)] = tmpl
                else:
                    store.templates.pop((key, p.replica), None)
                if old and old != tmpl:
                    await claims.delete(store, rec.namespace, old)
                rec.children.add(p.replica)
            await apply_service(core, builders.service(obj), rec.body)
        for r in sorted(rec.children - want):
            await gone_ok(apps.delete_namespaced_deployment, builders.deployment_name(rec.name, r), rec.namespace)
            rec.children.discard(r)
            store.whole.pop((key, r), None)
            store.written.discard((key, r))
            old = store.templates.pop((key, r), None)
            if old:
                await claims.delete(store, rec.namespace, old)
        rec.synced = state


async def claim_template(store: Store, rec: Record, p: api.ReplicaPlacement) -> str | None:
    """The ResourceClaimTemplate of a replica on a DRA node, created and read back; None when it
    cannot be used (a GPU's UUID is unknown, or the API server dropped the capacity requests:
    then DRA nodes share nothing on this cluster, and what is placed there is placed again)."""
    want = claims.desired(store, rec.key, p)
    if want is None or not store.dra_capacity_ok:
        return None
    dropped = await claims.ensure(store, want, rec.body)
    if not dropped:
        return str(want["metadata"]["name"])
    message = (f"the API server dropped {', '.join(dropped)} from ResourceClaimTemplate {want['metadata']['name']}: "
               "the DRAConsumableCapacity feature gate is off (Kubernetes 1.34/1.35 need it on; 1.36 has it on by "
               "default), so a claim would take whole GPUs; vllmfit does not share GPUs through DRA on this cluster")
    logger.error("%s", message)
    post_event(rec.body, "Warning", "DRACapacityUnsupported", message)
    async with store.changing():
        store.dra_capacity_ok = False
        rec.conditions = report.set_condition(rec.conditions, "Placed", "False", "DRACapacityUnsupported", message,
                                                now(), rec.generation)
        store.mark([rec.key])
    store.tasks.append(asyncio.create_task(refresh_nodes(store, store.dra_nodes(), "DRA capacity requests are not kept")))
    return None


async def finish(store: Store, fx: Effects, *, strict: bool = True, hold: bool = True) -> None:
    """Post the events, then write in the order that keeps a crash safe (issue 14): what stops
    runs down before its release is written, what starts is booked (its status written) before
    it runs. So after a crash at any write the API holds the booking of whatever runs. With
    strict, a failed write of the handled object raises (Kopf retries); other failures are logged
    and left to the resync, which repairs children and statuses that differ from the records.
    With hold, then make Kubernetes hold what the ledger books (`place`)."""
    for body, type_, reason, message in fx.events:
        post_event(body, type_, reason, message)
    starting = {k for k in fx.sync if (r := store.records.get(k)) is not None and r.admitted}
    stopping = sorted(fx.sync - starting)
    # replicas that move or shrink leave GPUs another key may have just been booked on: first
    ordered = sorted(starting, key=lambda k: (not store.records[k].children, k))
    failed: list[str] = []
    with store.hold(fx.sync):
        store.mark(fx.mark - fx.sync)
        for key in stopping:
            if await _step(store, key, sync_children, strict):
                await _step(store, key, store.persist, strict)
            else:
                failed.append(key)
        for key in ordered:
            if failed:  # something that should have stopped may still run: book nothing new
                logger.warning("%s: not started while %s may still run; the resync retries", key, ", ".join(failed))
                store.records[key].synced = None
                continue
            if await _step(store, key, store.persist, strict):
                await _step(store, key, sync_children, strict)
    if hold:
        await place(store)


async def _step(store: Store, key: str, fn: Callable[[Store, str], Any] | Callable[[str], Any], strict: bool) -> bool:
    """One write of finish(); False when it failed (raised again with strict)."""
    try:
        await (fn(store, key) if fn is sync_children else fn(key))  # type: ignore[call-arg, arg-type]
        return True
    except (TimeoutError, ApiException, OSError) as e:
        if strict:
            raise
        what = f"{e.status} {e.reason}" if isinstance(e, ApiException) else str(e) or type(e).__name__
        logger.error("%s: writing %s failed: %s", key, "its Deployments" if fn is sync_children else "its status",
                     what)
        rec = store.records.get(key)
        if rec is not None:
            rec.synced = None
            post_event(rec.body, "Warning", "SyncFailed", f"writing its Deployments or status failed: {what}")
        return False


def covers(store: Store, namespace: str, labels: Mapping[str, str], name: str, where: str | None,
           *, pod: bool = False) -> bool:
    """Whether an admitted booking covers this Deployment (or bare pod) of vllmfit: its owner is
    admitted and one of its replicas is booked where the object runs (placement annotation)."""
    rec = store.records.get(f"{namespace}/{labels.get(builders.LABEL_DEPLOYMENT)}")
    if rec is None or not rec.admitted or rec.going:
        return False
    for p in rec.placement:
        mine = str(p.replica) == labels.get(builders.LABEL_REPLICA) if pod else \
            builders.deployment_name(rec.name, p.replica) == name
        if mine and (where is None and pod or where == builders.placement_text(p)):
            return True
    return False


async def gone_ok(delete: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Call a `delete_namespaced_*` API method; an object that is already gone (404) is fine."""
    try:
        await delete(*args)
    except ApiException as e:
        if e.status != 404:
            raise


def _ours(labels: Mapping[str, str] | None) -> bool:
    return bool(labels) and labels.get(builders.MANAGED_BY) == "vllmfit" and builders.LABEL_DEPLOYMENT in labels


async def sweep(store: Store, namespace: str | None = None, only: str | None = None) -> list[str]:
    """Delete every Deployment and bare pod vllmfit owns (found by label) that no admitted
    booking covers: left by a crash between writes, or by a record that changed meanwhile.
    Each is re-read and re-checked under its owner's child lock (sync_children holds it too).
    `only`: the deployment label to look at. Returns what was deleted ("Kind ns/name")."""
    apps, core = client.AppsV1Api(store.api), client.CoreV1Api(store.api)
    selector = f"{builders.MANAGED_BY}=vllmfit"
    if namespace is None:
        deps = await apps.list_deployment_for_all_namespaces(label_selector=selector)
        pods_ = await core.list_pod_for_all_namespaces(label_selector=selector)
    else:
        deps = await apps.list_namespaced_deployment(namespace, label_selector=selector)
        pods_ = await core.list_namespaced_pod(namespace, label_selector=selector)
    gone: list[str] = []
    for d in deps.items or []:
        meta = d.metadata
        labels = meta.labels or {}
        if not _ours(labels) or (only is not None and labels.get(builders.LABEL_DEPLOYMENT) != only):
            continue
        owner = f"{meta.namespace}/{labels[builders.LABEL_DEPLOYMENT]}"
        if covers(store, meta.namespace, labels, meta.name, (meta.annotations or {}).get(builders.ANNOTATION_PLACEMENT)):
            continue
        async with store.child_locks[owner]:
            try:
                d = await apps.read_namespaced_deployment(meta.name, meta.namespace)
            except ApiException as e:
                if e.status == 404:
                    continue
                raise
            where = (d.metadata.annotations or {}).get(builders.ANNOTATION_PLACEMENT)
            if covers(store, meta.namespace, d.metadata.labels or {}, meta.name, where):
                continue
            await gone_ok(apps.delete_namespaced_deployment, meta.name, meta.namespace)
            gone.append(f"Deployment {meta.namespace}/{meta.name}")
            rec = store.records.get(owner)
            if rec is not None:
                rec.synced = None  # written again when its record says it should run
                rec.children = {r for r in rec.children if builders.deployment_name(rec.name, r) != meta.name}
    for pod in pods_.items or []:
        meta = pod.metadata
        labels = meta.labels or {}
        if not _ours(labels) or any(o.controller for o in meta.owner_references or []) or (
                only is not None and labels.get(builders.LABEL_DEPLOYMENT) != only):
            continue  # pods of a ReplicaSet go with their Deployment
        if covers(store, meta.namespace, labels, meta.name,
                  (meta.annotations or {}).get(builders.ANNOTATION_PLACEMENT), pod=True):
            continue
        await gone_ok(core.delete_namespaced_pod, meta.name, meta.namespace)
        gone.append(f"Pod {meta.namespace}/{meta.name}")
    for what in gone:
        logger.warning("%s ran without an admitted booking: deleted", what)
    return gone


def rebook_reported(store: Store, fx: Effects) -> list[str]:
    """Reservations that reported another GPU than the one asked for: re-book their replicas on
    the GPU they hold (or give them back when it has not the room); pins learned from reports
    rewrite the replicas' Deployments. Hold the lock. Returns reservations to delete."""
    retire: list[str] = []
    for r in sorted(store.reservations.values(), key=lambda r: r.name):
        if not r.reported or r.terminating:
            continue
        on_it = {b.deployment for b in store.ledger.bookings_on(r.node, r.index)}
        moved, message = reservations.rebook(store, r)
        if message and not moved:  # the GPU it got has not the room: ask again
            store.reservations.pop(r.name, None)
            retire.append(r.name)
            fx.events.extend((store.records[k].body, "Warning", "ReservationMismatch", message)
                             for k in sorted(on_it) if k in store.records)
        for k in sorted(moved):
            if k in store.records:
                fx.events.append((store.records[k].body, "Normal", "Rebooked", message or ""))
            fx.sync.add(k)
            fx.mark.update({k} | builders.neighbours(store.ledger, builders.gpus_of(store.ledger, k)))
    for k, rec in store.records.items():  # pins learned from the reports, a whole-node holder gone or back
        if rec.admitted and rec.synced is not None and rec.synced != children_state(rec):
            fx.sync.add(k)
    return retire


async def place(store: Store) -> None:
    """Make Kubernetes hold what the ledger books: re-book on the GPUs reservations really got,
    create and delete reservation pods on device-plugin nodes, then lift the scheduling gates of
    the replica pods whose GPUs are held."""
    try:
        fx = Effects()
        async with store.lock:
            retire = rebook_reported(store, fx)
            if fx.sync or fx.mark or retire:
                store.changes += 1
        for name in retire:
            await gone_ok(client.CoreV1Api(store.api).delete_namespaced_pod, name, store.options.reservation.namespace)
        await finish(store, fx, strict=False, hold=False)
        await reservations.sync(store)
        await reservations.ungate(store)
    except (ApiException, OSError) as e:
        logger.error("placement backend: %s", e)


# --- Kopf handlers -----------------------------------------------------------------------------


async def reconcile(body: Mapping[str, Any], *, force: bool) -> None:
    """create/update/resume: decide (or, when already admitted for this generation, only
    re-write the children and status), book, write."""
    store = get_store()
    await store.ready.wait()
    store.leading = True
    t0 = time.monotonic()
    fx = Effects()
    req: Request | None = None
    transient: str | None = None
    try:
        req = await store.request_for(parse(body))
    except Invalid as e:
        problem = ("Rejected", "InvalidSpec", str(e))
    except ModelResolutionError as e:
        problem = ("Pending", "ModelUnavailable", str(e)) if e.transient else ("Rejected", "ModelNotFound", str(e))
        transient = str(e) if e.transient else None
    async with store.lock:
        rec = store.upsert(body)  # under the lock: a resync may have replaced the record
        if req is None:
            store.changes += 1
            rec.observed_generation = rec.generation
            not_admitted(rec, *problem, fx, t=now())
            refresh_ready(rec, now())
            fx.mark.add(rec.key)
        elif (not force and rec.admitted and rec.observed_generation == rec.generation
              and not store.misplaced(rec.key)):  # nothing to decide (a resume, a repeated event)
            rec.request = req
            if rec.admitted_request is None and not rec.waiting:
                rec.admitted_request = req
            if rec.synced != children_state(rec):  # a resume after a restart, or an earlier write failed
                fx.sync.add(rec.key)
            fx.mark.add(rec.key)
        elif (not force and not rec.admitted and rec.request is not None and rec.outcome != "Pending"
              and rec.observed_generation == rec.generation):
            rec.request = req  # decided for this generation already; waiting specs are retried when room frees up
            fx.mark.add(rec.key)
        else:
            store.changes += 1
            keep = scale_keep(store, rec, req)
            apply_decision(store, rec, req, await bounded.decide(store.ledger, req, keep=keep), fx)
    await finish(store, fx)
    metrics.RECONCILE.observe(time.monotonic() - t0)
    if transient:
        raise kopf.TemporaryError(transient, delay=30)


@kopf.on.create(*RESOURCE, id="admit")
async def on_create(body: kopf.Body, **_: Any) -> None:
    await reconcile(body, force=False)


@kopf.on.update(*RESOURCE, id="readmit", field="spec")
async def on_update(body: kopf.Body, **_: Any) -> None:
    await reconcile(body, force=True)


@kopf.on.resume(*RESOURCE, id="resume")
async def on_resume(body: kopf.Body, **_: Any) -> None:
    await reconcile(body, force=False)


@kopf.on.event(*RESOURCE, id="adopt")
async def on_event(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A status this process did not write is news from the previous active peer (after a
    fail-over, Kopf replays every object): take its bookings, so nothing it admitted is lost.
    An object it never heard of is decided (idempotent: the create handler may do it too).
    A deletion seen here frees the booking even when the finalizer was never set (an object
    deleted right after its creation: the delete handler never runs for it)."""
    store = get_store()
    await store.ready.wait()
    store.leading = True
    if type == "DELETED":
        await forget(store, body)
        return
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    async with store.lock:
        if store.adopt(body):
            store.changes += 1
            logger.info("%s: took the status another replica wrote", key_of(body))
    if key_of(body) not in store.records:  # handled by a peer that died before writing its status
        await reconcile(body, force=False)


async def forget(store: Store, body: Mapping[str, Any]) -> None:
    """The object is going or gone: stop its Deployments and bare pods first, then free its GPUs
    (so a crash in between leaves its booking, never a pod on GPUs booked to another); its
    neighbours' headroom grows; waiting specs get another chance."""
    key = key_of(body)
    rec = store.records.get(key)
    uid = (body.get("metadata") or {}).get("uid")
    if rec is None or (uid and (rec.body.get("metadata") or {}).get("uid") not in (None, uid)):
        return  # already forgotten, or a new object of the same name
    rec.going = True  # no booking covers its children any more; sync_children only deletes
    async with store.child_locks[key]:
        pass  # a write of its children in flight ends first
    await sweep(store, rec.namespace, only=rec.name)
    rec.children.clear()
    fx = Effects()
    async with store.changing():
        if store.records.get(key) is not rec:
            return
        before = builders.gpus_of(store.ledger, key)
        store.ledger.release(key)
        store.records.pop(key, None)
        fx.mark.update(builders.neighbours(store.ledger, before))
        if before:
            await retry_waiting(store, fx)
    await finish(store, fx, strict=False)


@kopf.on.delete(*RESOURCE, id="release")
async def on_delete(body: kopf.Body, **_: Any) -> None:
    """Free its GPUs once its Deployments are gone (forget). A failed deletion raises: Kopf
    retries and the finalizer stays."""
    store = get_store()
    await store.ready.wait()
    await forget(store, body)


def node_info(body: Mapping[str, Any], pods: Mapping[str, str] | None = None,
              previous: placement.NodeInfo | None = None) -> placement.NodeInfo | None:
    """The node's GPUs, or None when it has none (no GFD labels, no inventory). `pods` maps the
    UIDs of vllmfit's pods to their deployment (their memory is booked, not foreign). Raises
    placement.NodeDataError (a LookupError) when its GPU labels or inventory are refused
    (malformed, out of range, not believable): the caller keeps `previous`, never evicts."""
    read = placement.read_node(body, catalog.gpu_for_label, pods, now=datetime.now(UTC), previous=previous,
                              policy=get_store().options.budget)
    if read.problem:
        raise placement.NodeDataError(read.problem)
    return read.info


def attribute(store: Store, node: str, body: Mapping[str, Any], t: str) -> None:
    """Observed memory per deployment from the agent's inventory (status.observed, MemoryDrift)."""
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(defaults.INVENTORY_ANNOTATION)
    if not raw:
        store.attributions.pop(node, None)
        return
    try:
        inv = inventory.GpuInventory.model_validate_json(raw)
    except pydantic.ValidationError:
        return
    uids = {uid: rec.key for rec in store.records.values() for uid in rec.pod_uids.values()}
    att = attribution.attribute(inv, uids)
    store.attributions[node] = att
    for key in store.ledger.deployments():
        rec = store.records.get(key)
        mine = [b for b in store.ledger.bookings_of(key) if b.node == node]
        if rec is None or not mine:
            continue
        entries, warn = [], []
        for b in mine:
            unit = att.units.get(b.index)
            if unit is None or not unit.attributable or b.index not in att.by_deployment.get(key, {}):
                continue  # nothing measured for it there (not running yet, or processes not listed)
            seen = att.observed(key, b.index)
            drift, bad = attribution.drift(b.footprint.total, seen)
            entries.append(api.ObservedMemory(node=node, index=b.index, used_bytes=seen,
                                              predicted_bytes=b.footprint.total, drift_bytes=drift,
                                              sampled_at=att.sampled_at))
            if bad:
                warn.append(f"{node} GPU {b.index}: uses {memory.fmt_gib(seen)}, predicted "
                            f"{memory.fmt_gib(b.footprint.total)}")
        rec.observed = [o for o in rec.observed if o.node != node] + entries
        if entries or warn:
            rec.conditions = report.set_condition(
                rec.conditions, "MemoryDrift", "True" if warn else "False",
                "AbovePrediction" if warn else "WithinPrediction",
                "; ".join(warn) or "observed GPU memory is within the prediction", t, rec.generation)
        store.mark([key])


@kopf.on.event("", "v1", "nodes", id="nodes")
async def on_node(type: str | None, body: kopf.Body, **_: Any) -> None:
    """Capacity, labels, the agent's inventory, or the node itself changed: update the ledger,
    move what no longer fits, give waiting specs a chance when room grew."""
    store = get_store()
    await store.ready.wait()
    name = (body.get("metadata") or {}).get("name") or ""
    try:
        info = None if type == "DELETED" else node_info(body, store.managed_pods(), store.ledger.nodes.get(name))
    except placement.NodeDataError as e:
        await node_data_refused(store, name, str(e).splitlines()[0])
        return
    except (LookupError, pydantic.ValidationError) as e:
        logger.warning("node %s: GPU information unreadable, keeping what was known: %s", name,
                       str(e).splitlines()[0])
        return
    on_node = {b.deployment for k in store.ledger.deployments() for b in store.ledger.bookings_of(k) if b.node == name}
    for key in on_node:  # re-placing needs resolved models: resolve them before taking the lock
        rec = store.records.get(key)
        if rec is not None and rec.request is None:
            try:
                rec.request = await store.request_for(parse(rec.body))
            except (Invalid, ModelResolutionError):
                pass
    fx, t = Effects(), now()
    async with store.changing():
        if type == "DELETED":
            store.node_infos.pop(name, None)
        else:
            store.node_infos[name] = info
            info = store.effective_node(name, info)
        await update_node(store, name, info, fx, "was removed" if type == "DELETED" else "no longer reports GPUs")
        if info is not None:
            attribute(store, name, body, t)
        node_data_condition(store, name, None, fx, t)
    await finish(store, fx, strict=False)


NODE_DATA = "NodeData"
"""Condition on the deployments of a node whose GPU labels or inventory were refused."""


async def node_data_refused(store: Store, name: str, problem: str) -> None:
    """A node's GPU labels or inventory were refused (core.placement.read_node): the node keeps
    its last good state; say so with a metric, and a condition and an Event on its deployments."""
    logger.warning("node %s: GPU information refused, keeping what was known: %s", name, problem)
    metrics.NODE_DATA_REFUSED.labels(name).inc()
    fx, t = Effects(), now()
    async with store.changing():
        node_data_condition(store, name, problem, fx, t)
    await finish(store, fx, strict=False)


def node_data_condition(store: Store, name: str, problem: str | None, fx: Effects, t: str) -> None:
    """Set (problem) or clear (None) the NodeData condition of the deployments booked on `name`;
    an Event when it turns False or its message changes. Hold the lock."""
    keys = {b.deployment for k in store.ledger.deployments() for b in store.ledger.bookings_of(k) if b.node == name}
    for key in sorted(keys):
        rec = store.records.get(key)
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


async def update_node(store: Store, name: str, info: placement.NodeInfo | None, fx: Effects, gone: str) -> None:
    """Put a node's GPUs into the ledger (hold the lock): move what no longer fits, give waiting
    specs a chance when room grew; rewrite the children whose GPU binding changed (a node moved
    from the device plugin to DRA)."""
    old = store.ledger.nodes.get(name)
    if info != old:
        slots = [(s.node, s.index) for s in (old.gpus if old else ())]
        before = {k: store.ledger.headroom_bytes(*k) for k in slots}
        if info is None:
            store.ledger.remove_node(name)
            cause = f"node {name} {gone}"
        else:
            store.ledger.set_node(info)
            cause = f"node {name} changed ({', '.join(info.warnings) or 'capacity, labels or foreign use'})"
        await replan(store, name, fx, cause)
        grew = info is not None and (old is None or any(
            store.ledger.headroom_bytes(s.node, s.index) > before.get((s.node, s.index), 0) for s in info.gpus))
        if grew:
            await retry_waiting(store, fx)
        fx.mark.update(builders.neighbours(store.ledger, {(s.node, s.index) for s in info.gpus} if info else set()))
    for k, rec in store.records.items():
        if rec.admitted and rec.synced is not None and any(p.node == name for p in rec.placement) \
                and rec.synced != children_state(rec):
            fx.sync.add(k)


async def refresh_nodes(store: Store, names: set[str], why: str) -> None:
    """Slices or claims changed: the DRA view of these nodes again (as on_node does)."""
    if not names:
        return
    for key in {b.deployment for k in store.ledger.deployments() for b in store.ledger.bookings_of(k)
                if b.node in names}:
        rec = store.records.get(key)
        if rec is not None and rec.request is None:
            try:
                rec.request = await store.request_for(parse(rec.body))
            except (Invalid, ModelResolutionError):
                pass
    fx = Effects()
    async with store.changing():
        for name in sorted(names):
            await update_node(store, name, store.effective_node(name, store.node_infos.get(name)), fx,
                              f"has no shareable GPUs any more ({why})")
    await finish(store, fx, strict=False)


async def read_log(store: Store, pod: Mapping[str, Any], previous: bool) -> str:
    meta = pod.get("metadata") or {}
    try:
        return str(await client.CoreV1Api(store.api).read_namespaced_pod_log(
            str(meta.get("name")), str(meta.get("namespace")), container=pods.CONTAINER, tail_lines=50,
            previous=previous))
    except (ApiException, OSError, ValueError) as e:
        logger.info("pod %s: cannot read its log: %s", meta.get("name"), e)
        return ""


@kopf.on.event("", "v1", "pods", id="pods",
               labels={builders.LABEL_DEPLOYMENT: kopf.PRESENT, builders.MANAGED_BY: "vllmfit"})
async def on_pod(type: str | None, body: kopf.Body, **_: Any) -> None:
    """Ready means serving: reflect the health of its pods in Ready, phase and Events."""
    store = get_store()
    await store.ready.wait()
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    key = f"{meta.get('namespace') or 'default'}/{labels.get(builders.LABEL_DEPLOYMENT)}"
    name = meta.get("name") or ""
    if key not in store.records:
        return
    health = None
    if type != "DELETED":
        health = pods.pod_health(body)
        if health.needs_log:
            cs: Mapping[str, Any] = next((c for c in (body.get("status") or {}).get("containerStatuses") or []
                                          if c.get("name") == pods.CONTAINER), {})
            cache_key = (meta.get("uid") or name, cs.get("restartCount", 0))
            cached = store.log_cache.get(cache_key)
            if cached is None:
                if len(store.log_cache) > 1000:
                    store.log_cache.clear()
                tail = await read_log(store, body, previous=bool((cs.get("state") or {}).get("waiting")))
                cached = store.log_cache[cache_key] = pods.pod_health(body, tail)
            health = cached
    async with store.changing():
        rec = store.records.get(key)
        if rec is None:
            return
        if health is None:
            rec.pods.pop(name, None)
            rec.pod_uids.pop(name, None)
        else:
            try:
                replica = int(labels.get(builders.LABEL_REPLICA, "0"))
            except ValueError:
                replica = 0
            rec.pods[name] = (replica, health)
            if meta.get("uid"):
                rec.pod_uids[name] = meta["uid"]
        old = next((c for c in rec.conditions if c.type == "Ready"), None)
        refresh_ready(rec, now())
        new = next(c for c in rec.conditions if c.type == "Ready")
        store.mark([key])
    if old is None or (old.status, old.reason, old.message) != (new.status, new.reason, new.message):
        if new.status == "True" and (old is None or old.status != "True"):
            post_event(rec.body, "Normal", "Ready", new.message)
        elif new.status != "True" and new.reason not in SETTLING and (old is None or old.reason != new.reason):
            post_event(rec.body, "Warning", new.reason, new.message)


# --- Start-up, clean-up, login -----------------------------------------------------------------


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings the operator relies on: handler progress in annotations (not in status,
    which belongs to vllmfit and is pruned by the CRD schema), our own finalizer name."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"


async def load_config() -> client.Configuration:
    """In-cluster config, else the current kubeconfig context."""
    cfg = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=cfg)
    except kube_config.ConfigException:
        try:
            await kube_config.load_kube_config(client_configuration=cfg)
        except (kube_config.ConfigException, OSError) as e:
            raise kopf.TemporaryError(f"no Kubernetes API: not in a cluster, and no usable kubeconfig ({e})",
                                      delay=10) from None
    return cfg


@kopf.on.login(id="login")
async def login(**_: Any) -> kopf.ConnectionInfo:
    """Kopf uses the same credentials as the operator's own API client."""
    store = get_store()
    cfg = store.kube_config or await load_config()
    token = (cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization") or "").removeprefix("Bearer ")
    return kopf.ConnectionInfo(server=str(cfg.host), ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               scheme="Bearer" if token else None, token=token or None,
                               certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
                               default_namespace=store.options.namespace)


async def list_cluster(store: Store) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every Node and every VLLMDeployment, as JSON."""
    nodes = await client.CoreV1Api(store.api).list_node()
    listed = await client.CustomObjectsApi(store.api).list_cluster_custom_object(*RESOURCE)
    return store.api.sanitize_for_serialization(nodes).get("items") or [], listed.get("items") or []


async def resync_once(store: Store) -> bool:
    """store.resync from a fresh listing, unless anything changed meanwhile or statuses are
    still being written. Returns whether it resynced. On the active replica it then repairs
    (level-based, whatever events were missed or writes lost): statuses that differ from the
    records, children that differ from the bookings (written, or deleted by `sweep`), objects
    that never got a decision, and waiting specs, which get another chance."""
    if store.busy():
        return False
    before = store.changes
    nodes, deployments = await list_cluster(store)
    fx = Effects()
    async with store.lock:
        if store.changes != before or store.busy():
            return False
        repair = store.resync(nodes, deployments)
        if store.leading:
            if repair:
                logger.warning("resync: rewriting statuses that differ from the records: %s", ", ".join(sorted(repair)))
            fx.mark.update(repair)
            fx.sync.update(k for k, r in store.records.items() if r.admitted and r.synced != children_state(r)
                           and r.admitted_request is not None)
            await retry_waiting(store, fx)
        undecided = [r.body for r in store.records.values() if not (r.written or {}).get("phase")]
    if not store.leading:
        return True
    await finish(store, fx, strict=False)
    await sweep(store)
    for body in undecided:
        logger.warning("resync: %s has no status; deciding it", key_of(body))
        await reconcile(body, force=False)
    return True


async def resync_loop(store: Store, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await resync_once(store)
        except Exception as e:  # noqa: BLE001 - a failed listing is retried next time
            logger.warning("resync failed: %s", e)


@kopf.on.startup(id="rebuild")
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Rebuild the ledger from the API before any handler allocates: every node, and the
    bookings recorded in the status of every admitted VLLMDeployment."""
    configure(settings)
    store = get_store()
    await store.stop()
    store.reset()
    if store.api is not None:
        await store.api.close()
    store.api = client.ApiClient(store.kube_config or await load_config())
    node_dicts, deployments = await list_cluster(store)
    await claims.load(store)  # the DRA nodes' GPUs and claims, before the ledger is rebuilt
    problems = store.rebuild(node_dicts, deployments)
    await reservations.load(store)
    for p in problems:
        logger.warning("start-up: %s", p)
    logger.info("ledger rebuilt: %d GPU nodes, %d VLLMDeployments, %d with bookings", len(store.ledger.nodes),
                len(store.records), len(store.ledger.deployments()))
    try:
        await sweep(store)
    except (ApiException, OSError) as e:
        logger.warning("start-up: cannot look for Deployments without a booking (the resync retries): %s", e)
    store.start()
    if store.options.resync_seconds > 0:
        store.tasks.append(asyncio.create_task(resync_loop(store, store.options.resync_seconds)))
    metrics.register()
    port = os.environ.get("VLLMFIT_METRICS_PORT")
    if port:
        metrics.serve(int(port))


@kopf.on.cleanup(id="cleanup")
async def cleanup(**_: Any) -> None:
    store = get_store()
    await store.stop()
    if store.api is not None:
        await store.api.close()
        store.api = None


# --- Placement backends: reservation pods and scheduling gates -----------------------------------


@kopf.on.event("", "v1", "pods", id="reservations", labels={rsv.ROLE_LABEL: rsv.ROLE, builders.MANAGED_BY: "vllmfit"})
async def on_reservation(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A reservation pod reported its GPU, or ended: re-book on the GPU it really holds when that
    is another than the one asked for; create or delete reservations; lift gates."""
    store = get_store()
    await store.ready.wait()
    async with store.changing():
        r = reservations.observe(store, body, type == "DELETED")
        waiting = None if r is None else rsv.unschedulable(body)
        events = []
        if r is not None and waiting and store.reservation_waits.get(r.name) != waiting:
            store.reservation_waits[r.name] = waiting
            text = (f"the reservation pod {r.name} for {r.node} GPU {r.index} cannot be scheduled: {waiting}; "
                    "the replica waits behind its scheduling gate")
            events = [(store.records[k].body, "Warning", "ReservationPending", text)
                      for k in sorted({b.deployment for b in store.ledger.bookings_on(r.node, r.index)})
                      if k in store.records]
        elif r is None or not waiting:
            store.reservation_waits.pop(str((body.get("metadata") or {}).get("name")), None)
    for event in events:
        post_event(*event)
    await place(store)


@kopf.on.event("", "v1", "pods", id="gates",
               labels={builders.LABEL_DEPLOYMENT: kopf.PRESENT, builders.MANAGED_BY: "vllmfit"})
async def on_gated_pod(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A replica pod behind the reservation gate: lift it once its GPUs are held."""
    store = get_store()
    await store.ready.wait()
    async with store.lock:
        reservations.track(store, body, type == "DELETED")
    if reservations.has_gate(body):
        await reservations.ungate(store)
    failure = None if type == "DELETED" else dra.allocation_failure(body)
    if failure:
        await allocation_failed(store, body, failure)


async def allocation_failed(store: Store, pod: Mapping[str, Any], message: str) -> None:
    """The scheduler could not allocate a replica's claim (a race lost to another claim, or the
    ledger was stale): say so with the scheduler's words, and decide the deployment again on the
    ledger as it is now (the winning claim is foreign use by then)."""
    meta = pod.get("metadata") or {}
    key = f"{meta.get('namespace') or 'default'}/{(meta.get('labels') or {}).get(builders.LABEL_DEPLOYMENT)}"
    fx = Effects()
    async with store.changing():
        rec = store.records.get(key)
        if rec is None or not rec.admitted or message == rec.allocation_failure:
            return
        rec.allocation_failure = message
        req = rec.request or rec.admitted_request
        text = f"the scheduler could not allocate the GPU claim of pod {meta.get('name')}: {message}"
        fx.events.append((rec.body, "Warning", "AllocationFailed", text))
        rec.conditions = report.set_condition(rec.conditions, "Placed", "False", "AllocationFailed", text, now(),
                                                rec.generation)
        fx.mark.add(key)
        for name in {p.node for p in rec.placement}:
            await update_node(store, name, store.effective_node(name, store.node_infos.get(name)), fx, "has no GPUs")
        if req is not None and store.records.get(key) is rec and rec.admitted:
            before = builders.gpus_of(store.ledger, key)
            old = store.ledger.release(key)
            d = await bounded.decide(store.ledger, req)
            same = sorted((b.node, b.index) for b in d.bookings()) == sorted((b.node, b.index) for b in old)
            if d.admitted and not same:
                apply_decision(store, rec, req, d, fx, cause="the scheduler could not allocate its claim")
            else:
                store.ledger.restore(key, old)  # nowhere better: stay (the scheduler retries), condition kept
            fx.mark.update(builders.neighbours(store.ledger, before))
    await finish(store, fx, strict=False)


@kopf.on.event("resource.k8s.io", "v1", "resourceslices", id="slices")
async def on_slice(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A DRA driver (re)published GPUs: the nodes' GPUs and backends follow."""
    await observe_dra(claims.observe_slice, body, type == "DELETED", "ResourceSlice changed")


@kopf.on.event("resource.k8s.io", "v1", "resourceclaims", id="claims")
async def on_claim(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A claim was allocated or released: foreign use on its GPUs changed."""
    await observe_dra(claims.observe_claim, body, type == "DELETED", "ResourceClaim changed")


async def observe_dra(observe: Callable[[Store, Any, bool], Any], body: Any, deleted: bool, cause: str) -> None:
    """Record a DRA object in the store under its lock, then refresh the nodes it touched."""
    store = get_store()
    await store.ready.wait()
    async with store.lock:
        names = observe(store, body, deleted)
    await refresh_nodes(store, names, cause)
