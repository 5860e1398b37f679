"""RuntimeClasses: the cluster's are kept (vllmfit.operator.binding.runtime_classes); replicas refused for
want of the configured one are written once it is created."""

from __future__ import annotations

from typing import Any

import kopf

from vllmfit.operator.binding import runtime_classes as rcs
from vllmfit.operator.booking import report
from vllmfit.operator.handlers.children import sync_children
from vllmfit.operator.handlers.common import now, store_of
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
    for key, rec in list(store.cache.records.items()):
        placed = next((c for c in rec.conditions if c.type == "Placed"), None)
        if placed is None or placed.reason != rcs.REASON:
            continue
        async with store.books.changing():
            where = "; ".join(f"replica {p.replica}: {builders.placement_text(p)}" for p in rec.placement)
            rec.conditions = report.set_condition(rec.conditions, "Placed", "True", "Placed", where or "no replicas",
                                                    now(), rec.generation)
            rec.synced = None
            store.writer.mark([key])
        await sync_children(store, key)
