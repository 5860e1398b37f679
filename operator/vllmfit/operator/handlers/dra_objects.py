"""DRA objects: ResourceSlices (the nodes' GPUs) and ResourceClaims (foreign use)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf

from vllmfit.operator.binding import claims
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.common import store_of
from vllmfit.operator.handlers.writes import refresh_nodes

logger = logging.getLogger(__name__)


async def on_slice(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A DRA driver (re)published GPUs: the nodes' GPUs and backends follow."""
    await observe_dra(store_of(memo), claims.observe_slice, body, type == "DELETED", "ResourceSlice changed")


async def on_claim(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A claim was allocated or released: foreign use on its GPUs changed."""
    await observe_dra(store_of(memo), claims.observe_claim, body, type == "DELETED", "ResourceClaim changed")


async def observe_dra(store: Store, observe: Callable[[Store, Any, bool], Any], body: Any, deleted: bool, cause: str) -> None:
    """Record a DRA object in the store under its lock, then refresh the nodes it touched."""
    await store.books.ready.wait()
    async with store.books.transaction(counted=False):
        names = observe(store, body, deleted)
    await refresh_nodes(store, names, cause)
