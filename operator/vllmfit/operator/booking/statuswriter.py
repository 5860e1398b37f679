"""The status writer (one of the operator's four state objects, state.Store.writer): statuses of
marked keys are written in the background, one write per key at a time, each computed while
holding the books' lock from the record and the ledger as a critical section left them (issue 29), so a
neighbour's headroom is never overwritten by an older computation and no status is computed
from a half-changed ledger. Handlers that must write in a crash-safe order hold their keys
(`hold`) and write them themselves (`persist`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from vllmfit.core.spec import api
from vllmfit.operator.booking import report
from vllmfit.operator.booking.record import pruned, wrote

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
WRITERS = 16  # concurrent status writes


class StatusWriter:
    """Writes the status of marked keys from their record (`cache.records`) and the ledger
    (`books`), computed under the books' lock; `api` returns the API client of the moment (it
    is made at start-up)."""

    def __init__(self, books: Any, cache: Any, api: Callable[[], Any]) -> None:
        self.books = books  # state.Books
        self.cache = cache  # state.Cache
        self._api = api
        self.write_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # one status write per key
        self.holding: dict[str, int] = {}  # keys whose status a handler writes in order (the writer skips them)
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._busy = False
        self._writer: asyncio.Task[None] | None = None

    def busy(self) -> bool:
        """Statuses remain to be written (the API does not show the ledger yet)."""
        return bool(self._dirty or self._busy or self.holding)

    def mark(self, keys: Iterable[str]) -> None:
        """Write the status of these deployments soon (from their record at that time)."""
        self._dirty.update(k for k in keys if k in self.cache.records)
        self._wake.set()

    def start(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_loop(), name="vllmfit status writer")

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None

    async def flush(self, timeout: float = 30.0) -> None:
        """Wait until every marked status has been written (tests, benchmarks)."""
        async with asyncio.timeout(timeout):
            while self.busy():
                await asyncio.sleep(0.005)

    async def _write_loop(self) -> None:
        sem = asyncio.Semaphore(WRITERS)

        async def one(key: str) -> None:
            async with sem:
                await self._write(key)

        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                self._busy = True
                keys, self._dirty = sorted(self._dirty), set()
                await asyncio.gather(*(one(k) for k in keys))
            self._busy = False

    @contextlib.contextmanager
    def hold(self, keys: Iterable[str]) -> Any:
        """While inside, the background writer leaves these keys' statuses to the caller, which
        writes them in the order that keeps a crash safe (handlers.finish)."""
        keys = list(keys)
        for k in keys:
            self.holding[k] = self.holding.get(k, 0) + 1
        try:
            yield
        finally:
            for k in keys:
                self.holding[k] -= 1
                if not self.holding[k]:
                    del self.holding[k]
            self.mark(keys)

    async def persist(self, key: str, missing_ok: bool = False) -> None:
        """Write the status of `key` now, from its record; raises when the write fails. Booking
        before running (and stopping before releasing) rests on this write having happened, so
        an object that is gone (404) is a failed write, unless `missing_ok` (what is being
        released: a deleted object books nothing)."""
        from kubernetes_asyncio.client import ApiException

        try:
            await self._patch_status(key)
        except ApiException as e:
            if e.status != 404 or not missing_ok:
                raise

    async def _patch_status(self, key: str) -> None:
        from kubernetes_asyncio.client import CustomObjectsApi

        async with self.write_locks[key]:
            async with self.books.transaction(counted=False):  # the record and the ledger as a critical section left them
                rec = self.cache.records.get(key)
                if rec is None:
                    return
                status = report.status(rec, self.books.ledger)
            kept = pruned(status)  # what the API will show: the record keeps that, not the patch
            if kept == rec.written:
                return
            rec.mine = True  # before the write: its echo may arrive before the answer
            await report.unread(CustomObjectsApi(self._api()).patch_namespaced_custom_object_status,
                                api.GROUP, api.VERSION, rec.namespace, api.PLURAL, rec.name, {"status": status},
                                _content_type=MERGE_PATCH)
            if self.cache.records.get(key) is rec:
                wrote(rec, kept)

    async def _write(self, key: str) -> None:
        from kubernetes_asyncio.client import ApiException

        if key in self.holding:
            return  # the handler holding it writes it, then marks it again
        try:
            await self._patch_status(key)
        except ApiException as e:
            if e.status == 404:
                return
            logger.warning("%s: writing status failed (%s %s); retrying", key, e.status, e.reason)
            asyncio.get_running_loop().call_later(1.0, self.mark, [key])
        except Exception as e:  # noqa: BLE001 - a lost connection must not kill the writer
            logger.warning("%s: writing status failed (%s); retrying", key, e)
            asyncio.get_running_loop().call_later(1.0, self.mark, [key])
