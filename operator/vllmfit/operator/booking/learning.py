"""The learned records (vllmfit.core.memory.learned) in the ConfigMap the operator owns.

`vllmfit-calibration` (defaults.CALIBRATION_CONFIGMAP) in the operator's own namespace, created
by the operator, key `records.json`. Only that object counts: it is read back at start-up by name
in that namespace and nowhere else, and it counts only when it carries the operator's managed-by
label (a ConfigMap a tenant made elsewhere, or one without the label, is never read; RBAC lets only
the operator and cluster administrators write in its namespace). Each record names its namespace
(none: cluster-wide, an admin's or one taught in the operator's namespace), who taught it
(`source`) and when (`learnedAt`); records older than defaults.LEARNED_RECORD_TTL_SECONDS are
dropped when read. A record refused by the core's
checks keeps nothing of that object (a warning), so the operator predicts as if it had learned
nothing: the records only ever add bytes to a booking, so losing them is safe.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.core import defaults
from vllmfit.core.errors import UserError
from vllmfit.core.memory import learned
from vllmfit.operator.booking.state import Store

logger = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


def namespace(store: Store) -> str:
    return store.options.namespace or store.options.reservation.namespace


def records_from_configmap(cm: dict[str, Any]) -> list[learned.Record]:
    """The records of the operator's ConfigMap (as a dict). Raises UserError when unusable."""
    labels = (cm.get("metadata") or {}).get("labels") or {}
    if labels.get(defaults.MANAGED_BY_LABEL) != defaults.MANAGED_BY:
        raise UserError(f"ConfigMap {defaults.CALIBRATION_CONFIGMAP} is not labelled "
                        f"{defaults.MANAGED_BY_LABEL}={defaults.MANAGED_BY}; ignored")
    text = (cm.get("data") or {}).get(defaults.CALIBRATION_KEY)
    if not isinstance(text, str):
        raise UserError(f"ConfigMap {defaults.CALIBRATION_CONFIGMAP} has no key {defaults.CALIBRATION_KEY}")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"ConfigMap {defaults.CALIBRATION_CONFIGMAP}: {defaults.CALIBRATION_KEY} is not JSON: {e}") \
            from None
    return learned.records_from_data(data)


def configmap(store: Store) -> dict[str, Any]:
    text = json.dumps({"records": [r.as_data() for r in store.cache.learned]}, indent=1, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": defaults.CALIBRATION_CONFIGMAP, "namespace": namespace(store),
                         "labels": {defaults.MANAGED_BY_LABEL: defaults.MANAGED_BY}},
            "data": {defaults.CALIBRATION_KEY: text}}


async def load(store: Store) -> None:
    """Read the records back at start-up (none: nothing learned yet)."""
    try:
        obj = await client.CoreV1Api(store.api).read_namespaced_config_map(
            defaults.CALIBRATION_CONFIGMAP, namespace(store), _preload_content=False)
        cm = json.loads(await obj.read())
    except ApiException as e:
        if e.status != 404:
            logger.warning("learned records: cannot read ConfigMap %s/%s: %s %s", namespace(store),
                           defaults.CALIBRATION_CONFIGMAP, e.status, e.reason)
        return
    except (OSError, ValueError) as e:
        logger.warning("learned records: cannot read ConfigMap %s: %s", defaults.CALIBRATION_CONFIGMAP, e)
        return
    try:
        store.cache.learned = learned.current(records_from_configmap(cm), int(time.time()))  # aged out: dropped
    except UserError as e:
        logger.warning("learned records: %s", e)
        return
    logger.info("learned records: %d configuration(s) read back", len(store.cache.learned))


async def save(store: Store) -> None:
    """Write the records (create the ConfigMap the first time). Failures are logged; the next
    learned start writes them all again."""
    if not store.cache.learned_dirty:
        return
    store.cache.learned_dirty = False
    core = client.CoreV1Api(store.api)
    body = configmap(store)
    try:
        try:
            await core.patch_namespaced_config_map(defaults.CALIBRATION_CONFIGMAP, namespace(store),
                                                   {"data": body["data"], "metadata": {"labels": body["metadata"]["labels"]}},
                                                   _content_type=MERGE_PATCH)  # type: ignore[call-arg]
        except ApiException as e:
            if e.status != 404:
                raise
            await core.create_namespaced_config_map(namespace(store), body)
    except (ApiException, OSError) as e:
        store.cache.learned_dirty = True
        logger.warning("learned records: cannot write ConfigMap %s: %s", defaults.CALIBRATION_CONFIGMAP, e)
