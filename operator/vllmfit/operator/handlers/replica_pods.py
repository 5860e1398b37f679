"""The pods of vLLM replicas: their health (Ready, logs), the reservation gate, and a GPU
claim the scheduler could not allocate."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.backends import dra
from vllmfit.operator import metrics
from vllmfit.operator.admission import bounded
from vllmfit.operator.binding import reservations
from vllmfit.operator.booking import draining, pods, report
from vllmfit.operator.booking.report import now, post_event
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.common import SETTLING, Effects, store_of
from vllmfit.operator.handlers.decide import apply_decision, refresh_ready, update_node
from vllmfit.operator.handlers.writes import finish, settle_drains
from vllmfit.operator.rendering import builders

logger = logging.getLogger(__name__)


async def read_log(store: Store, pod: Mapping[str, Any], previous: bool) -> str:
    meta = pod.get("metadata") or {}
    try:
        return str(await client.CoreV1Api(store.api).read_namespaced_pod_log(
            str(meta.get("name")), str(meta.get("namespace")), container=pods.CONTAINER, tail_lines=50,
            previous=previous))
    except (ApiException, OSError, ValueError) as e:
        logger.info("pod %s: cannot read its log: %s", meta.get("name"), e)
        return ""


async def on_pod(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Ready means serving: reflect the health of its pods in Ready, phase and Events."""
    store = store_of(memo)
    await store.books.ready.wait()
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    key = f"{meta.get('namespace') or 'default'}/{labels.get(builders.LABEL_DEPLOYMENT)}"
    name = meta.get("name") or ""
    if (type == "DELETED" or (body.get("status") or {}).get("phase") in draining.FINISHED) \
            and any(d.stopped for d in store.books.drains.of(key)):
        await settle_drains(store, {key})  # a stopped replica's pod is gone: its memory may be free
    if key not in store.cache.records:
        return
    health = None
    if type != "DELETED":
        health = pods.pod_health(body)
        if health.needs_log:
            cs: Mapping[str, Any] = next((c for c in (body.get("status") or {}).get("containerStatuses") or []
                                          if c.get("name") == pods.CONTAINER), {})
            cache_key = (meta.get("uid") or name, cs.get("restartCount", 0))
            cached = store.cache.log_cache.get(cache_key)
            if cached is None:
                if len(store.cache.log_cache) > 1000:
                    store.cache.log_cache.clear()
                tail = await read_log(store, body, previous=bool((cs.get("state") or {}).get("waiting")))
                cached = store.cache.log_cache[cache_key] = pods.pod_health(body, tail)
            health = cached
    async with store.books.changing():
        rec = store.cache.records.get(key)
        if rec is None:
            return
        if health is None:
            gone = rec.pods.pop(name, None)
            rec.pod_uids.pop(name, None)
            if gone is not None:  # its next pod starts afresh: not started until seen so (issue 34)
                store.cache.started.discard((key, gone[0]))
        else:
            try:
                replica = int(labels.get(builders.LABEL_REPLICA, "0"))
            except ValueError:
                replica = 0
            rec.pods[name] = (replica, health)
            if meta.get("uid"):
                store.cache.pod_seen(rec, name, str(meta["uid"]))
        old = next((c for c in rec.conditions if c.type == "Ready"), None)
        refresh_ready(rec, now())
        new = next(c for c in rec.conditions if c.type == "Ready")
        store.writer.mark([key])
    if old is None or (old.status, old.reason, old.message) != (new.status, new.reason, new.message):
        if new.status == "True" and (old is None or old.status != "True"):
            post_event(rec.body, "Normal", "Ready", new.message)
        elif new.status != "True" and new.reason not in SETTLING and (old is None or old.reason != new.reason):
            post_event(rec.body, "Warning", new.reason, new.message)
            if new.reason == "OverLimit":
                metrics.over_limit(key)


async def on_gated_pod(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A replica pod behind the reservation gate: lift it once its GPUs are held."""
    store = store_of(memo)
    await store.books.ready.wait()
    async with store.books.transaction(counted=False):
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
    async with store.books.changing():
        rec = store.cache.records.get(key)
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
            await update_node(store, name, store.effective_node(name, store.cache.node_infos.get(name)), fx, "has no GPUs")
        if req is not None and store.cache.records.get(key) is rec and rec.admitted:
            before = builders.gpus_of(store.books.ledger, key)
            without = store.books.ledger.fork()  # decided on a copy without it; the writer's ledger unchanged meanwhile
            old = without.release(key)
            d = await bounded.decide(store.workers, without, req)
            same = sorted((b.node, b.index) for b in d.bookings()) == sorted((b.node, b.index) for b in old)
            if d.admitted and not same:  # applied in one step
                store.books.writing.release(key)
                apply_decision(store, rec, req, d, fx, cause="the scheduler could not allocate its claim")
                draining.hold(store.books.writing, store.books.drains, key, old)
            # else nowhere better: it stays (the scheduler retries), condition kept
            fx.mark.update(builders.neighbours(store.books.ledger, before))
    await finish(store, fx, strict=False)
