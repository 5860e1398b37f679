"""A VLLMDeployment's children: its Deployments (one per replica), its Service, and on DRA
nodes its ResourceClaimTemplates, written to match its record."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import kopf
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException
from pydantic import BaseModel

from vllmfit.backends import binding
from vllmfit.backends import reservation as rsv
from vllmfit.backends.enforcement import ANNOTATION as enforcement_annotation
from vllmfit.backends.enforcement import CHOSEN as enforcement_chosen
from vllmfit.backends.enforcement import NONE as enforcement_none
from vllmfit.backends.enforcement import of_pod as enforcement_of_pod
from vllmfit.core.spec import api
from vllmfit.operator import metrics
from vllmfit.operator.binding import claims, enforcement, reservations
from vllmfit.operator.binding import runtime_classes as runtimeclasses
from vllmfit.operator.booking import draining, report
from vllmfit.operator.booking.record import Record
from vllmfit.operator.booking.report import as_json, now, post_event, unread
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.common import JSON_PATCH, MERGE_PATCH, gone_ok
from vllmfit.operator.rendering import builders, lws, verifier

logger = logging.getLogger(__name__)


async def apply_deployment(apps: client.AppsV1Api, make: Callable[..., dict[str, Any]], exclusive: bool,
                           owner: Mapping[str, Any], enforce: str = enforcement_none) -> tuple[bool, str]:
    """Create the Deployment, or on 409 replace its spec (JSON Patch: KMock has no PUT). A
    replica whose placement did not change keeps its GPU pinning mode and its enforcement (switching
    would restart it; an agent that misses a report must not restart what runs). Returns whether it
    is pinned with device-plugin limits, and the enforcement it was written with (`enforce` for a
    new one: backends.enforcement.choose)."""
    manifest = make(exclusive, enforce)
    kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
    meta = manifest["metadata"]
    try:
        await unread(apps.create_namespaced_deployment, meta["namespace"], manifest)
        return exclusive, enforce
    except ApiException as e:
        if e.status != 409:
            raise
    existing = await apps.read_namespaced_deployment(meta["name"], meta["namespace"])
    annotations = (existing.metadata.annotations or {}) if existing.metadata else {}
    same_place = annotations.get(builders.ANNOTATION_PLACEMENT) == meta["annotations"][builders.ANNOTATION_PLACEMENT]
    was_exclusive = annotations.get(builders.ANNOTATION_PINNING) == binding.PIN_DEVICE_PLUGIN
    old_tpl = existing.spec.template if existing.spec else None
    was_enforced = ((old_tpl.metadata.annotations or {}) if old_tpl is not None and old_tpl.metadata else {}).get(
        enforcement_annotation) or enforcement_none
    kept = was_enforced if same_place and was_enforced in enforcement_chosen and was_enforced != enforce else enforce
    if same_place and was_exclusive != exclusive or kept != enforce:
        exclusive = was_exclusive if same_place else exclusive
        manifest = make(exclusive, kept)
        kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
        meta = manifest["metadata"]
        enforce = kept
    tpl = manifest["spec"]["template"]
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
    await unread(apps.patch_namespaced_deployment, meta["name"], meta["namespace"], patch, _content_type=JSON_PATCH)
    return exclusive, enforce


async def apply_service(core: client.CoreV1Api, manifest: dict[str, Any], owner: Mapping[str, Any]) -> None:
    kopf.adopt(manifest, owner=dict(owner))  # type: ignore[arg-type]
    meta = manifest["metadata"]
    try:
        await unread(core.create_namespaced_service, meta["namespace"], manifest)
    except ApiException as e:
        if e.status != 409:
            raise
        patch = {"metadata": {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]},
                 "spec": {"selector": manifest["spec"]["selector"], "ports": manifest["spec"]["ports"]}}
        await unread(core.patch_namespaced_service, meta["name"], meta["namespace"], patch, _content_type=MERGE_PATCH)


def desired_object(rec: Record) -> api.VLLMDeployment | None:
    """The VLLMDeployment its children are rendered from: its metadata and its admitted spec
    (None: restored with an update pending, its admitted spec unknown)."""
    req = rec.admitted_request
    if req is None or rec.flags is None:
        return None
    return api.VLLMDeployment(metadata=api.ObjectMeta.model_validate(rec.body["metadata"]), spec=req.spec)


def replica_inputs(store: Store, rec: Record, obj: api.VLLMDeployment, p: api.ReplicaPlacement,
                   table: reservations.UuidTable | None = None) -> dict[str, Any]:
    """Every argument of builders.deployment for one replica, save the three its writer settles
    against the Deployment that exists (apply_deployment: `exclusive`, the GPU pinning mode a
    replica keeps where it stays, `gated`, the reservation gate a running replica is never
    restarted to get, and `enforce`, the enforcement it keeps where it stays). The writer renders from exactly these (`builders.deployment(**inputs,
    exclusive=..., gated=...)`), and they are the children's cache key (children_state), so no
    input of the rendering can be left out of the key."""
    assert rec.admitted_request is not None and rec.flags is not None
    committed = store.books.committed
    mine = [b for b in committed.bookings_of(rec.key, p.replica) if b.node == p.node]  # a group's pod: its node's
    want = claims.desired(store, rec.key, p) if store.backend_of(p.node) == "dra" else None
    return {"obj": obj, "replica": p, "flags": rec.flags, "model_name": rec.admitted_request.model.name,
            "revision": rec.admitted_request.model.revision,
            "weights_bytes": sum(b.footprint.weights for b in mine), "pins": reservations.pins(store, rec.key, p, table),
            "claim_template": str(want["metadata"]["name"]) if want else None, "booked": builders.booked_text(mine),
            "runtime_class": store.options.reservation.runtime_class, "mps": store.options.mps,
            "verify": verifier.check_for(obj.spec, rec.admitted_request.model, store.options.reservation.image)}


def children_state(store: Store, rec: Record, table: reservations.UuidTable | None = None) -> bytes:
    """The children's cache key (rewrite them only when it changed), derived, not listed by hand:
    whether they run, which replicas wait for drains, each replica's backend (a DRA replica is
    written only with its claim template), and the inputs each replica's Deployment is rendered
    from (replica_inputs: builders.deployment's arguments, as the writer passes them; the Service
    is rendered from the same object). `table`: a reservations.uuid_table of the store as it is,
    for a pass over many records. A digest of their text (every input is a value type: pydantic
    models, as their JSON, and dataclasses, strings, numbers, lists and dicts, as their repr), so
    each record keeps 16 bytes, not the objects (a parsed VLLMDeployment and each replica's
    inputs: 3.5 KB a record)."""
    running = rec.admitted and not rec.going
    obj = desired_object(rec) if running else None
    blocked = tuple(waiting_for_drains(store, rec))
    digest = hashlib.blake2b(repr((running, obj is not None, blocked)).encode(), digest_size=16)
    if obj is not None:
        digest.update(obj.model_dump_json().encode())  # once, not once per replica (pydantic's repr: 6x slower)
        for p in rec.placement:
            for q in p.pods() if p.replica not in blocked else ():
                inputs = replica_inputs(store, rec, obj, q, table)
                digest.update(repr((store.backend_of(q.node), [(k, _token(v)) for k, v in inputs.items() if k != "obj"])).encode())
    return digest.digest()


def _token(value: Any) -> Any:
    """A value of children_state's key as text: a pydantic model as its JSON, anything else as is."""
    return value.model_dump_json() if isinstance(value, BaseModel) else value


def waiting_for_drains(store: Store, rec: Record) -> list[int]:
    """Replicas that may not start yet: on one of their GPUs a stopped replica's pods may still
    hold memory the GPU has no room for besides them (break-then-make; draining.blocked)."""
    return [p.replica for p in rec.placement if draining.blocked(store.books.committed, store.books.drains, rec.key, p.replica)]


def stopping(rec: Record) -> list[int]:
    """Replicas whose Deployment runs where the record no longer books them (scaled down, moved)."""
    now = {p.replica: builders.placement_text(p) for p in rec.placement} if rec.admitted and not rec.going else {}
    return sorted(r for r in rec.children if r not in now or rec.child_where.get(r, now[r]) != now[r])


async def stop_children(store: Store, key: str) -> None:
    """Delete the Deployments of the replicas that stop (scale-down, move), before the status
    that releases them is written (finish); their memory stays booked as drains until their
    pods are gone."""
    async with store.cache.child_locks[key]:
        rec = store.cache.records.get(key)
        if rec is None:
            return
        apps = client.AppsV1Api(store.api)
        for r in stopping(rec) + [r for r in waiting_for_drains(store, rec) if r in rec.children]:
            await delete_child(store, rec, apps, r)


async def delete_child(store: Store, rec: Record, apps: client.AppsV1Api, r: int) -> None:
    if r in rec.groups:
        await delete_group(store, rec.namespace, builders.deployment_name(rec.name, r))
        rec.groups.discard(r)
    else:
        await gone_ok(apps.delete_namespaced_deployment, builders.deployment_name(rec.name, r), rec.namespace)
    rec.children.discard(r)
    rec.child_where.pop(r, None)
    rec.synced = None
    key = rec.key
    if (held := store.cache.whole.pop((key, r), None)) is not None:
        store.cache.pins_dirty.add(held)  # a whole-node holder gone: its neighbours' pins may change
    store.cache.written.discard((key, r))
    for d in store.books.drains.of(key):  # no pod of it can start any more: its drains can end
        if d.replica == r:
            d.stopped = True
    old = store.cache.templates.pop((key, r), None)
    if old:
        await claims.delete(store, rec.namespace, old)


async def sync_children(store: Store, key: str) -> None:
    """Make the Deployments and the Service of `key` match its record (now, not when marked)."""
    async with store.cache.child_locks[key]:
        rec = store.cache.records.get(key)
        if rec is None:
            return
        state = children_state(store, rec)
        if rec.synced == state:
            return  # written by a concurrent call meanwhile
        apps, core = client.AppsV1Api(store.api), client.CoreV1Api(store.api)
        want: set[int] = set()
        blocked = set(waiting_for_drains(store, rec))
        modes: dict[int, tuple[str, str]] = {}  # replica -> (node, how its booking is enforced)
        if rec.admitted and not rec.going:
            obj = desired_object(rec)
            if obj is None:
                return  # restored with an update pending: its admitted spec is unknown; leave them
            for p in rec.placement:
                if p.replica in blocked:
                    continue  # break-then-make: it starts once the pods on its GPUs are gone
                want.add(p.replica)
                if (p.replica in rec.groups) != bool(p.workers) and p.replica in rec.children:
                    await delete_child(store, rec, apps, p.replica)  # across nodes now, or no longer: the other kind
                if p.workers:
                    await write_group(store, rec, obj, p)
                    continue
                inputs = replica_inputs(store, rec, obj, p)
                tmpl: str | None = None
                if store.backend_of(p.node) == "dra":
                    tmpl = await claim_template(store, rec, p)
                    if tmpl is None:
                        continue  # no template it can use: its Deployment is not written (condition, Event)
                ex = builders.exclusive(store.books.committed, key, p.node, [g.index for g in p.gpus]) and not tmpl
                if not ex and not tmpl and (why := await runtimeclasses.refusal(store)):
                    await refuse(store, rec, runtimeclasses.REASON, why)
                    continue  # its pods could not start: not written (condition, Event)
                gated = reservations.gated(store, key, p)
                booked = inputs["booked"]

                def make(exclusive: bool, enforce: str, inputs: dict[str, Any] = inputs, gated: bool = gated,
                         tmpl: str | None = tmpl) -> dict[str, Any]:
                    return builders.deployment(**{**inputs, "claim_template": tmpl}, enforce=enforce,
                                               exclusive=exclusive and not tmpl, gated=gated and not exclusive)

                held = store.cache.whole.get((key, p.replica))
                whole, enforced = await apply_deployment(apps, make, ex, rec.body, enforcement.mode(store, p.node))
                modes[p.replica] = (p.node, enforcement_of_pod(whole and not tmpl, not whole and not tmpl, enforced,
                                                               inputs["mps"] is not None))
                if whole and not tmpl:
                    store.cache.whole[(key, p.replica)] = p.node
                else:
                    store.cache.whole.pop((key, p.replica), None)
                if store.cache.whole.get((key, p.replica)) != held:  # a whole-node holder came or went there:
                    store.cache.pins_dirty.update(n for n in (held, p.node) if n)  # its neighbours' pins may change
                store.cache.written.add((key, p.replica))
                old = store.cache.templates.get((key, p.replica))
                if tmpl:
                    store.cache.templates[(key, p.replica)] = tmpl
                else:
                    store.cache.templates.pop((key, p.replica), None)
                if old and old != tmpl:
                    await claims.delete(store, rec.namespace, old)
                rec.children.add(p.replica)
                rec.child_where[p.replica] = where = builders.placement_text(p)
                for d in store.books.drains.of(key):  # moved or resized: the Deployment's old pods are being stopped
                    if d.replica == p.replica and (d.where != where or d.booked not in ("", booked)):
                        d.stopped = True
            await apply_service(core, builders.service(obj), rec.body)
            if await enforcement.report_modes(store, rec, modes):
                metrics.not_enforced(rec.key)
        for r in sorted(rec.children - want):
            await delete_child(store, rec, apps, r)
        rec.synced = state


async def refuse(store: Store, rec: Record, reason: str, message: str) -> None:
    """A replica's children cannot be written as they are: `Placed` False and a Warning Event
    (once per message: a resync does not post it again)."""
    placed = next((c for c in rec.conditions if c.type == "Placed"), None)
    if placed is not None and placed.status == "False" and placed.reason == reason and placed.message == message:
        return
    logger.error("%s: %s", rec.key, message)
    post_event(rec.body, "Warning", reason, message)
    async with store.books.changing():
        rec.conditions = report.set_condition(rec.conditions, "Placed", "False", reason, message, now(),
                                                rec.generation)
        store.writer.mark([rec.key])


async def claim_template(store: Store, rec: Record, p: api.ReplicaPlacement) -> str | None:
    """The ResourceClaimTemplate of a replica on a DRA node, created and read back; None when it
    cannot be used (a GPU's UUID is unknown, or the API server dropped the capacity requests:
    then DRA nodes share nothing on this cluster, and what is placed there is placed again)."""
    want = claims.desired(store, rec.key, p)
    if want is None and (why := claims.unsatisfiable(store, rec.key, p)):
        await refuse(store, rec, claims.NOT_GRANTABLE, f"replica {p.replica}: {why}")
        return None
    if want is None or not store.cache.dra_capacity_ok:
        return None
    dropped = await claims.ensure(store, want, rec.body)
    if not dropped:
        return str(want["metadata"]["name"])
    message = (f"the API server dropped {', '.join(dropped)} from ResourceClaimTemplate {want['metadata']['name']}: "
               "the DRAConsumableCapacity feature gate is off (Kubernetes 1.34/1.35 need it on; 1.36 has it on by "
               "default), so a claim would take whole GPUs; vllmfit does not share GPUs through DRA on this cluster")
    logger.error("%s", message)
    post_event(rec.body, "Warning", "DRACapacityUnsupported", message)
    async with store.books.changing():
        store.cache.dra_capacity_ok = False
        rec.conditions = report.set_condition(rec.conditions, "Placed", "False", "DRACapacityUnsupported", message,
                                                now(), rec.generation)
        store.writer.mark([rec.key])
    store.cache.dra_refresh = "DRA capacity requests are not kept"  # finish() refreshes the DRA nodes
    return None


# --- a replica across nodes: its LeaderWorkerSet ---------------------------------------------------


def groups_served(store: Store) -> bool:
    """Whether this cluster serves LeaderWorkerSets (discovered at start-up: no multi-node refusal)."""
    return store.books.ledger.multi_node is None


async def list_groups(store: Store, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
    """vllmfit's LeaderWorkerSets (found by label), as JSON with their kind; none where not served."""
    if not groups_served(store):
        return []
    crd = client.CustomObjectsApi(store.api)
    selector = selector or builders.selector()
    try:
        if namespace is None:
            got = await as_json(crd.list_cluster_custom_object, lws.GROUP, lws.VERSION, lws.PLURAL,
                                label_selector=selector)
        else:
            got = await as_json(crd.list_namespaced_custom_object, lws.GROUP, lws.VERSION, namespace, lws.PLURAL,
                                label_selector=selector)
    except ApiException as e:
        if e.status != 404:
            raise
        return []
    return [{**item, "kind": lws.KIND} for item in got.get("items") or []]


async def delete_group(store: Store, namespace: str, name: str) -> None:
    """Delete a LeaderWorkerSet in the foreground: it is listed until its StatefulSets and their
    pods are gone, so its group's drain holds until then (draining.group_holds)."""
    delete = partial(client.CustomObjectsApi(store.api).delete_namespaced_custom_object,
                     propagation_policy="Foreground")
    await gone_ok(delete, lws.GROUP, lws.VERSION, namespace, lws.PLURAL, name)


async def write_group(store: Store, rec: Record, obj: api.VLLMDeployment, p: api.ReplicaPlacement) -> bool:
    """Create or replace the LeaderWorkerSet of replica `p` (its leader and its workers, each pod
    bound to its own node's GPUs as a one-node replica's pod is). Returns whether it was written
    (not: `Placed` False with the reason, and an Event)."""
    assert rec.flags is not None and rec.admitted_request is not None
    pods = p.pods()
    if any(store.backend_of(q.node) == "dra" for q in pods):
        await refuse(store, rec, GROUP_UNSUPPORTED, f"replica {p.replica}: a replica across nodes is not bound "
                     "through DRA claims; place it on device-plugin nodes")
        return False
    committed = store.books.committed
    ex = [builders.exclusive(committed, rec.key, q.node, [g.index for g in q.gpus]) for q in pods]
    if not all(ex) and (why := await runtimeclasses.refusal(store)):
        await refuse(store, rec, runtimeclasses.REASON, why)
        return False
    inputs = [replica_inputs(store, rec, obj, q) for q in pods]
    try:
        manifest = lws.leader_worker_set(
            obj, pods, rec.flags, rec.admitted_request.model.name, exclusive=ex,
            weights_bytes=sum(i["weights_bytes"] for i in inputs),
            gated=[reservations.gated(store, rec.key, q) and not e for q, e in zip(pods, ex, strict=True)],
            booked=[i["booked"] for i in inputs],
            binding=[{k: i[k] for k in ("pins", "runtime_class", "mps", "verify", "revision")} for i in inputs])
    except ValueError as e:
        await refuse(store, rec, GROUP_UNSUPPORTED, f"replica {p.replica}: {e}")
        return False
    kopf.adopt(manifest, owner=dict(rec.body))  # type: ignore[arg-type]
    meta, crd = manifest["metadata"], client.CustomObjectsApi(store.api)
    try:
        await unread(crd.create_namespaced_custom_object, lws.GROUP, lws.VERSION, meta["namespace"], lws.PLURAL,
                     manifest)
    except ApiException as e:
        if e.status != 409:
            raise
        patch = [{"op": "add", "path": f"/metadata/{k}", "value": meta[k]}
                 for k in ("labels", "annotations", "ownerReferences")]
        patch.append({"op": "add", "path": "/spec", "value": manifest["spec"]})
        await unread(crd.patch_namespaced_custom_object, lws.GROUP, lws.VERSION, meta["namespace"], lws.PLURAL,
                     meta["name"], patch, _content_type=JSON_PATCH)
    store.cache.written.add((rec.key, p.replica))
    rec.children.add(p.replica)
    rec.groups.add(p.replica)
    rec.child_where[p.replica] = where = builders.placement_text(p)
    for d in store.books.drains.of(rec.key):  # moved: the group's old pods are being stopped
        if d.replica == p.replica and d.where != where:
            d.stopped = True
    return True


GROUP_UNSUPPORTED = "GroupNotWritten"
