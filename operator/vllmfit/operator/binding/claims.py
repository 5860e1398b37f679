"""The operator's side of the DRA backend: ResourceSlices and ResourceClaims in, one
ResourceClaimTemplate per replica out. The decisions are pure (vllmfit.backends.dra).

- `observe_slice` / `observe_claim`: keep the objects (hold the lock); the Store turns them into
  the DRA nodes' GPUs and foreign use (`Store.effective_node`);
- `desired`: the template a replica on a DRA node needs (per GPU: UUID and the bytes booked);
- `ensure`: create it (owned by the VLLMDeployment), read it back, and refuse to share when the
  API server dropped the capacity requests (DRAConsumableCapacity off);
- `load`: everything, at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.backends import dra
from vllmfit.core.spec import api
from vllmfit.operator.booking.state import Store

logger = logging.getLogger(__name__)

GROUP, VERSION = "resource.k8s.io", "v1"
SLICES, CLAIMS, TEMPLATES = "resourceslices", "resourceclaims", "resourceclaimtemplates"


def claim_key(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def claim_nodes(store: Store, body: Mapping[str, Any] | None) -> set[str]:
    """The nodes whose devices a claim's allocation uses."""
    if not body:
        return set()
    pools = {(d.driver, d.pool): n for n, devs in store.devices().items() for d in devs}
    results = ((((body.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])
    return {pools[k] for r in results if (k := (str(r.get("driver")), str(r.get("pool")))) in pools}


def observe_slice(store: Store, body: Mapping[str, Any], deleted: bool) -> set[str]:
    """Record a slice (hold the lock). Returns the nodes it concerns (before and after)."""
    name = str((body.get("metadata") or {}).get("name") or "")
    old = store.cache.slices.pop(name, None)
    if not deleted:
        store.cache.slices[name] = dict(body)
    store.cache.slices_changed()
    return {str(n) for n in ((old or {}).get("spec", {}).get("nodeName"),
                             (body.get("spec") or {}).get("nodeName")) if n}


def observe_claim(store: Store, body: Mapping[str, Any], deleted: bool) -> set[str]:
    """Record a claim (hold the lock). Returns the nodes whose devices it used or uses."""
    key = claim_key(body)
    old = store.cache.claims.pop(key, None)
    if not deleted:
        store.cache.claims[key] = dict(body)
    return claim_nodes(store, old) | claim_nodes(store, body)


NOT_GRANTABLE = "ClaimNotGrantable"


def unsatisfiable(store: Store, key: str, p: api.ReplicaPlacement) -> str | None:
    """Why no claim can ask for what replica `p` booked on a DRA node (a device's request policy
    cannot grant it), in one line; None when a claim can (or it is not known yet)."""
    try:
        _, gpus, devices = wanted(store, key, p) or (None, [], [])
        if not gpus:
            return None
        dra.claim_template("", "x", "x", p.replica, gpus, device_class=store.options.dra_device_class,
                           driver=store.options.dra_driver, devices=devices)
    except dra.Unsatisfiable as e:
        return str(e)
    return None


def wanted(store: Store, key: str, p: api.ReplicaPlacement
           ) -> tuple[str, list[tuple[str, int]], list[dra.Device | None]] | None:
    """(namespace/name, [(UUID, bytes booked)] per GPU, their devices) of a replica on a DRA node;
    None elsewhere, or while a GPU's UUID is unknown."""
    if store.backend_of(p.node) != "dra":
        return None
    need: dict[int, int] = {}
    for b in store.books.ledger.bookings_of(key, p.replica):
        if b.node == p.node:
            need[b.index] = need.get(b.index, 0) + b.footprint.predicted  # measured growth rewrites no claim
    gpus = []
    by_uuid = {d.uuid: d for d in store.devices().get(p.node, []) if d.uuid}
    for g in p.gpus:
        slot = store.books.ledger.slot(p.node, g.index)
        if slot is None or not slot.uuid or g.index not in need:
            return None
        gpus.append((slot.uuid, need[g.index]))
    return key, gpus, [by_uuid.get(u) for u, _ in gpus]


def desired(store: Store, key: str, p: api.ReplicaPlacement) -> dict[str, Any] | None:
    """The ResourceClaimTemplate of a replica on a DRA node; None elsewhere, or while a GPU's
    UUID is unknown. Its name carries a digest of what it asks (templates are immutable)."""
    w = wanted(store, key, p)
    if w is None:
        return None
    _, gpus, devices = w
    ns, name = key.split("/", 1)
    try:
        t = dra.claim_template("", ns, name, p.replica, gpus, device_class=store.options.dra_device_class,
                               driver=store.options.dra_driver, devices=devices)
    except dra.Unsatisfiable as e:
        logger.error("%s replica %d: no claim can ask for what it booked: %s", key, p.replica, e)
        return None
    t["metadata"]["name"] = f"{dra.template_name(name, p.replica)}-{dra.fingerprint(t)[:10]}"
    return t


async def ensure(store: Store, template: dict[str, Any], owner: Mapping[str, Any]) -> list[str]:
    """Create the template (or find it), read it back. Returns the fields the API server dropped
    (then the template is deleted again: its claims would ask for whole GPUs)."""
    custom = client.CustomObjectsApi(store.api)
    kopf.adopt(template, owner=dict(owner))  # type: ignore[arg-type]
    meta = template["metadata"]
    try:
        await custom.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], TEMPLATES, template)
    except ApiException as e:
        if e.status != 409:
            raise
    stored = await custom.get_namespaced_custom_object(GROUP, VERSION, meta["namespace"], TEMPLATES, meta["name"])
    dropped = dra.dropped_fields(template, stored)
    if dropped:
        await delete(store, meta["namespace"], meta["name"])
    return dropped


async def delete(store: Store, namespace: str, name: str) -> None:
    try:
        await client.CustomObjectsApi(store.api).delete_namespaced_custom_object(GROUP, VERSION, namespace,
                                                                                 TEMPLATES, name)
    except ApiException as e:
        if e.status != 404:
            raise


async def load(store: Store) -> None:
    """Read every ResourceSlice, ResourceClaim and vllmfit's templates (start-up). A cluster that
    does not serve resource.k8s.io/v1 has none."""
    custom = client.CustomObjectsApi(store.api)
    try:
        slices = await custom.list_cluster_custom_object(GROUP, VERSION, SLICES)
        claims = await custom.list_cluster_custom_object(GROUP, VERSION, CLAIMS)
        templates = await custom.list_cluster_custom_object(GROUP, VERSION, TEMPLATES)
    except ApiException as e:
        if e.status in (403, 404):
            logger.info("resource.k8s.io/v1 not available (%s %s): the device-plugin backend only", e.status, e.reason)
            return
        raise
    for s in slices.get("items") or []:
        observe_slice(store, s, False)
    for c in claims.get("items") or []:
        observe_claim(store, c, False)
    for t in templates.get("items") or []:
        meta = t.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(dra.MANAGED_BY) != "vllmfit":
            continue
        try:
            replica = int(labels.get(dra.LABEL_REPLICA, ""))
        except ValueError:
            continue
        store.cache.templates[(f"{meta.get('namespace') or 'default'}/{labels.get(dra.LABEL_DEPLOYMENT)}", replica)] = \
            str(meta.get("name"))
