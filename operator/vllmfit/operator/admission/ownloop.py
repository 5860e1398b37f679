"""The webhook's own thread and event loop (issue 32, ninth round). The operator's event loop runs
Kopf's worker per object, their requests and the operator's own passes: in a burst thousands of
callbacks at a time, and a review queued behind them waited up to seconds. The HTTPS server
(webhookserver.Server) therefore runs on a loop of its own (`OwnLoop`), in a thread; it shares the
interpreter's lock with the operator, which hands it over every sys.getswitchinterval() while the
operator runs Python code. What must run on the operator's loop (its API client's aiohttp session
belongs there) is sent there and awaited (`at_home`). docs/webhook.md, "A review while the
operator is busy"."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import kopf

from vllmfit.core import defaults

T = TypeVar("T")

HOME: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar("vllmfit_home", default=None)
"""The operator's event loop, as a review answered on the webhook's own loop sees it (set per request)."""


async def at_home(make: Callable[[], Awaitable[T]]) -> T:
    """`await make()` on the operator's event loop: what needs the operator's API client or Kopf's
    machinery. Called on the webhook's loop, the coroutine runs there and this waits for it (and
    is cancelled with it); anywhere else (no HOME: the handlers, the tests) it runs in place."""
    home = HOME.get()
    if home is None or home is asyncio.get_running_loop():
        return await make()
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), home))  # type: ignore[arg-type]


class OwnLoop:
    """One coroutine on an event loop of its own, in a daemon thread: started and stopped from the
    operator's loop. `loop` is the thread's loop while it runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, main: Callable[[], Awaitable[None]], failed: Callable[[BaseException], None]) -> None:
        """Run `main()` on the thread's loop; `failed` is told (from the thread) what ended it, if
        anything but stop() did. Once at a time: Kopf starts the server again only after the
        previous run ended (and stop() was called)."""
        self.loop, self._task, self._started = None, None, threading.Event()

        async def run() -> None:
            self.loop, self._task = asyncio.get_running_loop(), asyncio.current_task()  # type: ignore[assignment]
            self._started.set()
            await main()

        def thread() -> None:
            try:
                asyncio.run(run())
            except asyncio.CancelledError:
                pass
            except BaseException as e:  # noqa: BLE001 - the starter raises it
                failed(e)
            finally:
                self._started.set()

        self._thread = threading.Thread(target=thread, name=self.name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel `main()` (its `finally` blocks run on its loop) and wait for the thread."""
        if self._thread is None:
            return
        if self._started.wait(timeout) and self.loop is not None and self._task is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout)

    async def answering(self, timeout: float = defaults.WEBHOOK_LOOP_PROBE_S) -> str:
        """The liveness probe's question: does the loop answer within `timeout`? Raises
        kopf.PermanentError (the probe fails, once) when it does not: something holds it (a review's
        quick decision that spins would be a bug)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return "not serving yet"
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop))
        except TimeoutError:
            raise kopf.PermanentError(f"the webhook's event loop did not answer within {timeout:g} s") from None
        return "answering"
