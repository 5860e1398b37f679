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
from vllmfit.core.spec import api
from vllmfit.operator import metrics, report
from vllmfit.operator.handlers.common import Effects, now
from vllmfit.operator.handlers.decide import resolve_requests_on, update_node
from vllmfit.operator.handlers.writes import finish
from vllmfit.operator.state import Store, get_store
from vllmfit.sources import catalog

logger = logging.getLogger(__name__)


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
    await resolve_requests_on(store, {name})
    fx, t = Effects(), now()
    async with store.changing():
        if type == "DELETED":
            store.node_infos.pop(name, None)
        else:
            store.node_infos[name] = info
            store.refused.discard(name)
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
