"""RuntimeClasses (node.k8s.io/v1): which the cluster has, so that a replica bound through
NVIDIA_VISIBLE_DEVICES is refused with a condition, not created to fail at start, when the
runtime class it needs (chart value `placement.reservation.runtimeClassName`) does not exist.

`store.cache.runtime_classes` is None until the first list (`known`, lazily; the watch in
handlers/runtimeclasses keeps it); a cluster where the operator may not list them (403/404) is
believed (nothing refused)."""

from __future__ import annotations

import logging

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.operator.booking.state import Store

logger = logging.getLogger(__name__)

REASON = "RuntimeClassNotFound"


async def known(store: Store) -> set[str] | None:
    """The RuntimeClasses of the cluster (listed once; the watch keeps them). None: unknown."""
    if store.cache.runtime_classes is None:
        try:
            listed = await client.NodeV1Api(store.api).list_runtime_class()
        except ApiException as e:
            if e.status in (403, 404):
                logger.info("RuntimeClasses cannot be listed (%s %s): none is checked", e.status, e.reason)
                return None
            raise
        store.cache.runtime_classes = {str(rc.metadata.name) for rc in listed.items or [] if rc.metadata}
    return store.cache.runtime_classes


async def refusal(store: Store) -> str | None:
    """Why a replica that needs the configured runtime class cannot run (None: it can, or no
    runtime class is configured, or the cluster's are unknown)."""
    want = store.options.reservation.runtime_class
    if not want:
        return None
    have = await known(store)
    if have is None or want in have:
        return None
    return (f"runtimeClass {want!r} does not exist in the cluster: replicas that share a GPU through "
            f"NVIDIA_VISIBLE_DEVICES need it (chart value placement.reservation.runtimeClassName; empty where "
            f"the NVIDIA runtime is the nodes' default)")
