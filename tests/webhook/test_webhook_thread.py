"""The webhook answers on its own thread and event loop (webhookserver.Server), so a review never
waits for the operator's loop: in a burst that loop runs thousands of Kopf workers at once, and a
review queued behind them waited up to seconds (benchmarks/operator_scale.py --reviews, issue 32).
What needs the operator's loop (its API client: the ConfigMaps a spec names) goes there
(`at_home`), and nothing else does."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import kopf
import pytest
from webhook_harness import FakeStore, Harness, admission_review, free_port, gfd_node, response_of, vllmd

from vllmfit.operator.admission import ownloop, webhook
from vllmfit.operator.booking import models

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"
NODES = [gfd_node("gpu-node-a", 1), gfd_node("gpu-node-b", 1)]


def review(client: httpx.Client, obj: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"/{webhook.VALIDATE_ID}", json=admission_review(obj))
    assert r.status_code == 200, r.text
    return response_of(r)


def test_a_review_is_answered_while_the_operators_loop_is_held() -> None:
    # The operator's loop is held by a callback that waits for the test (a thread wait: it gives
    # the interpreter lock away, as the operator's Python code does every switch interval). On the
    # code before, the review waited on that same loop and was never answered while it was held:
    # the client gave up after its 20 s (this test's only timeout, which only a failure reaches).
    held, release = threading.Event(), threading.Event()
    with Harness(FakeStore(NODES)) as h, httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=20) as c:
        assert review(c, vllmd("warm", model=MODEL_8B, maxModelLen=8192))["allowed"]
        assert h.loop is not None
        h.loop.call_soon_threadsafe(lambda: (held.set(), release.wait(60)))
        try:
            assert held.wait(10)
            answered = [review(c, vllmd(f"busy-{i}", model=MODEL_8B, maxModelLen=8192)) for i in range(3)]
            assert not release.is_set()  # all three answered while the operator's loop was still held
        finally:
            release.set()
        assert all(a["allowed"] for a in answered)
        assert h.server.own.alive()
    assert not h.server.own.alive()  # the operator stopped: the webhook's thread ended with it


class Recording(FakeStore):
    """Records the loop each model resolution ran on (modelConfigRef or not)."""

    def __init__(self, nodes: Any) -> None:
        super().__init__(nodes)
        self.loops: list[tuple[bool, asyncio.AbstractEventLoop]] = []

    async def request_for(self, obj: Any) -> Any:
        self.loops.append((obj.spec.model_config_ref is not None, asyncio.get_running_loop()))
        return await super().request_for(obj)


def test_only_what_needs_the_operators_api_client_runs_on_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's API client (an aiohttp session) belongs to its loop: a modelConfigRef and the
    # ConfigMaps an envFrom names are read there; a catalog model is resolved on the webhook's loop.
    sources: list[asyncio.AbstractEventLoop] = []
    env_sources = models.env_sources

    async def recorded(api_client: Any, obj: Any) -> Any:
        sources.append(asyncio.get_running_loop())
        return await env_sources(api_client, obj)

    monkeypatch.setattr(models, "env_sources", recorded)
    store = Recording(NODES)
    with Harness(store) as h, httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=20) as c:
        plain = review(c, vllmd("plain", model=MODEL_8B, maxModelLen=8192))
        ref = review(c, vllmd("ref", model="acme/custom-7b", maxModelLen=8192, modelConfigRef={"name": "cfg"}))
        env = review(c, vllmd("env", model=MODEL_8B, maxModelLen=8192,
                                 podTemplate={"spec": {"containers": [{"name": "vllm", "envFrom": [
                                     {"configMapRef": {"name": "settings"}}]}]}}))
    assert plain["allowed"]
    assert ref["allowed"] and "ConfigMap default/cfg not found" in ref["warnings"][0]  # resolved later
    assert not env["allowed"] and "ConfigMap settings: it could not be read" in env["status"]["message"]
    home = h.loop
    by_ref = dict(store.loops[-2:])  # (plain, ref); the env review is refused before resolution
    assert by_ref[True] is home
    assert by_ref[False] is not home
    assert sources == [home]


async def test_at_home_runs_in_place_outside_the_webhooks_loop() -> None:
    # No HOME (the operator's handlers, the tests calling webhook.review): nothing hops.
    loop = asyncio.get_running_loop()

    async def where() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert await ownloop.at_home(where) is loop
    token = ownloop.HOME.set(loop)
    try:
        assert await ownloop.at_home(where) is loop
    finally:
        ownloop.HOME.reset(token)


def test_the_liveness_probe_asks_the_webhooks_own_loop() -> None:
    # A review's quick decision runs on the webhook's loop: were one to spin (a bug), Kopf's loop
    # and its /healthz would go on answering. The probe (registered by webhook.setup) asks the
    # webhook's loop too, and fails while that loop is held.
    held, release = threading.Event(), threading.Event()
    with Harness(FakeStore(NODES)) as h:
        own = h.server.own
        assert h.run(own.answering(20)) == "answering"
        own.loop.call_soon_threadsafe(lambda: (held.set(), release.wait(60)))
        try:
            assert held.wait(10)
            with pytest.raises(kopf.PermanentError, match="did not answer within 0.2 s"):
                h.run(own.answering(0.2))  # held: no timeout is long enough
        finally:
            release.set()
        assert h.run(own.answering(20)) == "answering"


def test_healthz_fails_while_the_webhooks_loop_is_held() -> None:
    # End to end through Kopf's liveness endpoint: webhook.setup registers the probe; Kopf answers
    # 500 when a probe fails (and caches a good answer for 10 s, so the held loop is asked first).
    held, release = threading.Event(), threading.Event()
    harness = Harness(FakeStore(NODES))
    harness.liveness_endpoint = f"http://127.0.0.1:{free_port()}/healthz"  # as vllmfit-operator --health-port
    with harness as h:
        h.server.own.loop.call_soon_threadsafe(lambda: (held.set(), release.wait(60)))
        try:
            assert held.wait(10)
            assert httpx.get(h.liveness_endpoint, timeout=20).status_code == 500
        finally:
            release.set()
        r = httpx.get(h.liveness_endpoint, timeout=20)
        assert r.status_code == 200 and r.json()["webhook"] == "answering"


def test_a_review_that_needs_the_held_operators_loop_is_refused_within_its_budget() -> None:
    # The envFrom ConfigMaps are read on the operator's loop: while it is held, the review waits
    # within its budget (0.6 s of a 1 s webhook timeout) and is refused saying why, never allowed
    # unchecked and never left hanging (the client's 20 s would fail this test).
    held, release = threading.Event(), threading.Event()
    with Harness(FakeStore(NODES), ["--webhook-timeout-seconds", "1"]) as h, \
            httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=20) as c:
        assert h.loop is not None
        h.loop.call_soon_threadsafe(lambda: (held.set(), release.wait(60)))
        try:
            assert held.wait(10)
            answer = review(c, vllmd("env", model=MODEL_8B, maxModelLen=8192, podTemplate={"spec": {
                "containers": [{"name": "vllm", "envFrom": [{"configMapRef": {"name": "settings"}}]}]}}))
            assert not release.is_set()
        finally:
            release.set()
    assert not answer["allowed"] and answer["status"]["code"] == 429
    assert "reading the ConfigMaps its envFrom names" in answer["status"]["message"]
