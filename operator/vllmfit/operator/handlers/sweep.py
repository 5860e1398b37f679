"""The sweep: delete every Deployment, LeaderWorkerSet and bare pod of vllmfit that no admitted booking covers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.core import defaults
from vllmfit.operator.booking.record import key_of, shows
from vllmfit.operator.booking.report import as_json
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.children import delete_group, list_groups
from vllmfit.operator.handlers.common import RESOURCE, gone_ok
from vllmfit.operator.rendering import builders, lws

logger = logging.getLogger(__name__)


def covers(store: Store, namespace: str, labels: Mapping[str, str], name: str, where: str | None,
           *, pod: bool = False) -> bool:
    """Whether an admitted booking covers this Deployment (or bare pod) of vllmfit: its owner is
    admitted and one of its replicas is booked where the object runs (placement annotation)."""
    rec = store.cache.records.get(f"{namespace}/{labels.get(builders.LABEL_DEPLOYMENT)}")
    if rec is None or not rec.admitted or rec.going:
        return False
    for p in rec.placement:
        mine = str(p.replica) == labels.get(builders.LABEL_REPLICA) if pod else \
            builders.deployment_name(rec.name, p.replica) == name
        if mine and (where is None and pod or where == builders.placement_text(p)):
            return True
    return False


PER_OBJECT = (403, 409, 422)
"""Answers about one object that stop nothing else (issue 21 item 3): a tenant's lookalike in a
namespace vllmfit may not delete from (403), a conflict, an object the API server refuses."""


def _skipped(what: str, e: ApiException) -> None:
    logger.warning("sweep: %s left as it is: %s %s", what, e.status, e.reason)


async def _delete(delete: Callable[..., Awaitable[Any]], what: str, *args: Any) -> bool:
    """Delete one object; False when it was not deleted for a reason of its own (logged)."""
    try:
        await gone_ok(delete, *args)
        return True
    except ApiException as e:
        if e.status not in PER_OBJECT:
            raise
        _skipped(what, e)
        return False


def _ours(labels: Mapping[str, str] | None) -> bool:
    return bool(labels) and labels.get(builders.MANAGED_BY) == "vllmfit" and builders.LABEL_DEPLOYMENT in labels


async def sweep(store: Store, namespace: str | None = None, only: str | None = None,
                listed: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None) -> list[str]:
    """Delete every Deployment and bare pod vllmfit owns (found by label) that no admitted
    booking covers: left by a crash between writes, or by a record that changed meanwhile.
    Each is re-read and re-checked under its owner's child lock (sync_children holds it too).
    `only`: the deployment label to look at. `listed`: vllmfit's Deployments and pods as
    `list_ours` gave them (the resync's listing, not taken again); listed here otherwise.
    Returns what was deleted ("Kind ns/name")."""
    apps, core = client.AppsV1Api(store.api), client.CoreV1Api(store.api)
    if listed is not None:
        deps, pods_ = listed
    elif namespace is None:
        deps, pods_ = await list_ours(store)
    else:  # one deployment's (a deletion): only its own, not the namespace's (issue 32, --churn)
        selector = builders.selector(only)
        deps = (await as_json(apps.list_namespaced_deployment, namespace, label_selector=selector)).get("items") or []
        rec = store.cache.records.get(f"{namespace}/{only}")
        if only is None or rec is None or rec.groups or any(p.workers for p in rec.placement):
            deps += await list_groups(store, namespace, selector)  # only where it may have one: one listing less
        pods_ = (await as_json(core.list_namespaced_pod, namespace, label_selector=selector)).get("items") or []
    gone: list[str] = []
    for d in deps:
        meta = d.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not _ours(labels) or (only is not None and labels.get(builders.LABEL_DEPLOYMENT) != only):
            continue
        ns, name = meta.get("namespace"), meta.get("name")
        owner = f"{ns}/{labels[builders.LABEL_DEPLOYMENT]}"
        if covers(store, ns, labels, name, (meta.get("annotations") or {}).get(builders.ANNOTATION_PLACEMENT)):
            continue
        group = d.get("kind") == lws.KIND
        kind = lws.KIND if group else "Deployment"
        async with store.cache.child_locks[owner]:
            try:
                if group:
                    got = await as_json(client.CustomObjectsApi(store.api).get_namespaced_custom_object, lws.GROUP,
                                        lws.VERSION, ns, lws.PLURAL, name)
                else:
                    got = await as_json(apps.read_namespaced_deployment, name, ns)
                now = got.get("metadata") or {}
            except ApiException as e:
                if e.status == 404:
                    continue  # gone since the listing (the resync's is taken before its writes)
                if e.status not in PER_OBJECT:
                    raise
                _skipped(f"{kind} {ns}/{name}", e)
                continue
            where = (now.get("annotations") or {}).get(builders.ANNOTATION_PLACEMENT)
            if covers(store, ns, now.get("labels") or {}, name, where):
                continue
            delete = partial(delete_group, store) if group else apps.delete_namespaced_deployment
            if not await _delete(delete, f"{kind} {ns}/{name}", *((ns, name) if group else (name, ns))):
                continue
            gone.append(f"{kind} {ns}/{name}")
            rec = store.cache.records.get(owner)
            if rec is not None:
                rec.synced = None  # written again when its record says it should run
                rec.children = {r for r in rec.children if builders.deployment_name(rec.name, r) != name}
                rec.groups &= rec.children
    for pod in pods_:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not _ours(labels) or any(o.get("controller") for o in meta.get("ownerReferences") or []) or (
                only is not None and labels.get(builders.LABEL_DEPLOYMENT) != only):
            continue  # pods of a ReplicaSet go with their Deployment
        ns, name = meta.get("namespace"), meta.get("name")
        if covers(store, ns, labels, name, (meta.get("annotations") or {}).get(builders.ANNOTATION_PLACEMENT),
                  pod=True):
            continue
        if await _delete(core.delete_namespaced_pod, f"Pod {ns}/{name}", name, ns):
            gone.append(f"Pod {ns}/{name}")
    for what in gone:
        logger.warning("%s ran without an admitted booking: deleted", what)
    return gone


EXPIRED = 410
"""The API server's answer to a continue token older than its compaction window."""

READ_METADATA = ("name", "namespace", "uid", "labels", "annotations", "ownerReferences")
"""What the operator reads of a listed Deployment's or pod's metadata (the sweep, the drains,
children_at): a pod template, a container list or managedFields are never read."""


def _metadata(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {k: meta[k] for k in READ_METADATA if k in meta}


def child_read(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a listed Deployment of its own: its metadata."""
    return {"metadata": _metadata(obj)}


def pod_read(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a listed pod of its own: its metadata and phase."""
    return {"metadata": _metadata(obj), "status": {"phase": (obj.get("status") or {}).get("phase")}}


def node_read(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a listed Node (placement.node_from_object): its metadata and
    spec; never its status (a node's image list alone is tens of kilobytes) nor managedFields."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {k: v for k, v in (("apiVersion", obj.get("apiVersion")), ("kind", obj.get("kind")), ("metadata", meta),
                              ("spec", obj.get("spec"))) if v is not None}


def without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


class Abandoned(Exception):
    """A listing given up between two pages: what it was for would be thrown away (`paged`'s `abandon`)."""


async def paged(call: Callable[..., Awaitable[Any]], *args: Any, read: Callable[[dict[str, Any]], dict[str, Any]],
                abandon: Callable[[], bool] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Every item of a listing, as JSON, a page of defaults.LIST_PAGE at a time (client-go's
    pager): each page is trimmed to what the operator reads (`read`) before the next is asked
    for, and the event loop runs between pages, so neither a whole listing's JSON is held nor
    the loop held while it is decoded. A continue token that expired (410) starts it again,
    whole, as client-go's pager falls back to a full listing. `abandon`: asked before each page;
    when it says so, the listing stops there (raises Abandoned)."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        if abandon is not None and abandon():
            raise Abandoned(f"{getattr(call, '__name__', 'a listing')}: abandoned after {len(items)} items")
        try:
            page = await as_json(call, *args, limit=defaults.LIST_PAGE, _continue=token, **kwargs)
        except ApiException as e:
            if e.status != EXPIRED or token is None:
                raise
            page, items = await as_json(call, *args, **kwargs), []
        items.extend(read(o) for o in page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue") or None
        if token is None:
            return items
        await asyncio.sleep(0)


async def list_ours(store: Store, abandon: Callable[[], bool] | None = None,
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every Deployment and LeaderWorkerSet (a replica across nodes; `kind` set) and every pod
    vllmfit owns (found by label), as JSON; the Deployments and pods paged, trimmed to what the
    operator reads of them (`child_read`, `pod_read`); `abandon`: as `paged`'s."""
    apps, core = client.AppsV1Api(store.api), client.CoreV1Api(store.api)
    selector = builders.selector()
    deps = await paged(apps.list_deployment_for_all_namespaces, label_selector=selector, read=child_read,
                       abandon=abandon)
    groups = await list_groups(store, selector=selector)
    pods_ = await paged(core.list_pod_for_all_namespaces, label_selector=selector, read=pod_read, abandon=abandon)
    return deps + groups, pods_


def vllmdeployment_read(store: Store) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What the operator reads of a listed VLLMDeployment: the whole object less managedFields,
    its status and spec shared with its record when they are what the record shows (`shows`;
    its kept spec): the resync compares them and the rebuild of a record reads them, and neither
    needs them twice. At 40,000 deployments each resync held every status and spec a second
    time, 700 MiB above the operator's settled size."""

    def read(obj: dict[str, Any]) -> dict[str, Any]:
        obj = without_managed_fields(obj)
        rec = store.cache.records.get(key_of(obj))
        if rec is None:
            return obj
        status = obj.get("status")
        if status is not None and rec.written is not None and shows(rec, status):
            obj["status"] = rec.written
        if (spec := rec.body.get("spec")) is not None and obj.get("spec") == spec:
            obj["spec"] = spec
        return obj

    return read


async def list_cluster(store: Store, abandon: Callable[[], bool] | None = None,
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every Node (`node_read`) and every VLLMDeployment (`vllmdeployment_read`), as JSON, paged;
    `abandon`: as `paged`'s."""
    nodes = await paged(client.CoreV1Api(store.api).list_node, read=node_read, abandon=abandon)
    listed = await paged(client.CustomObjectsApi(store.api).list_cluster_custom_object, *RESOURCE,
                         read=vllmdeployment_read(store), abandon=abandon)
    return nodes, listed


async def lead(store: Store) -> None:
    """Become the active replica (standalone: at the first event; with peering: when Kopf
    resumes this one). A new leader first catches up with the cluster (the statuses the old
    leader wrote since the last resync) and sweeps what no booking covers, before it admits
    anything: a Deployment the old leader left between two writes never runs beside a newcomer."""
    if store.leading:
        return
    async with store.lead_lock:
        if store.leading:
            return
        try:
            nodes, deployments = await list_cluster(store)
            children, _ = await list_ours(store)  # a status it has not seen books only what runs where it says
            async with store.books.transaction(counted=False):
                if not store.writer.busy():
                    store.resync(nodes, deployments, children)
            await sweep(store)
        except (ApiException, OSError) as e:
            logger.warning("taking the lead: cannot look for Deployments without a booking (the resync retries): %s", e)
        store.leading = True
