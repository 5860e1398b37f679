"""RuntimeClasses: the cluster's are kept (vllmfit.operator.binding.runtime_classes); replicas refused for
want of the configured one are written once it is created."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from vllmfit.operator.binding import runtime_classes as rcs
from vllmfit.operator.booking import report
from vllmfit.operator.booking.report import now
from vllmfit.operator.booking.statuswriter import WRITERS
from vllmfit.operator.handlers.children import sync_children
from vllmfit.operator.handlers.common import store_of
from vllmfit.operator.rendering import builders


async def on_runtimeclass(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A RuntimeClass appeared or went: replicas refused for want of it are written again."""
    store = store_of(memo)
    await store.books.ready.wait()
    name = str((body.get("metadata") or {}).get("name") or "")
    have = await rcs.known(store)
    if have is None or not name:
        return
    if type == "DELETED":
        have.discard(name)
        return
    have.add(name)
    if name != store.options.reservation.runtime_class:
        return
    keys: list[str] = []
    async with store.books.changing():  # one critical section for all of them (not one each, behind every event)
        for key, rec in store.cache.records.items():
            placed = next((c for c in rec.conditions if c.type == "Placed"), None)
            if placed is None or placed.reason != rcs.REASON:
                continue
            where = "; ".join(f"replica {p.replica}: {builders.placement_text(p)}" for p in rec.placement)
            rec.conditions = report.set_condition(rec.conditions, "Placed", "True", "Placed", where or "no replicas",
                                                    now(), rec.generation)
            rec.synced = None  # a write that fails here is repaired by the resync (children differ)
            keys.append(key)
        store.writer.mark(keys)
    sem = asyncio.Semaphore(WRITERS)

    async def write(key: str) -> None:
        async with sem:
            await sync_children(store, key)

    failed = [e for e in await asyncio.gather(*(write(k) for k in keys), return_exceptions=True) if e is not None]
    if failed:
        raise failed[0]
