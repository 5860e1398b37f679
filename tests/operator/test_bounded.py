"""Bounded work (issue 14, items 3, 4, 8): a decision that runs past its time limit is denied
with a message, and the event loop (other handlers, the liveness probe, the webhook) keeps
running meanwhile, even when the decision is a pure-Python CPU loop that cannot be interrupted."""

# The real clock, on purpose (issue 29): a decision spinning in a worker thread must really outlast
# its time limit; on a virtual clock (looptime) a thread takes no loop time and no limit would pass.

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opkit import Cluster, Operator, node, vd

from vllmfit.core import defaults, placement
from vllmfit.core.spec import api
from vllmfit.operator.admission import bounded, webhook
from vllmfit.operator.booking.state import Workers
from vllmfit.sources import catalog

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
SLOW = "slow"  # the deployment name whose decision never ends by itself


@pytest.fixture
def spinning(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """placement.decide spins (pure Python, holding no lock it would release) for the
    deployment named SLOW, until the test ends."""
    stop = threading.Event()
    real = placement.decide

    def decide(ledger: Any, req: placement.Request, **kw: Any) -> placement.Decision:
        n = 0
        while req.key.endswith("/" + SLOW) and not stop.is_set():
            n += 1
        return real(ledger, req, **kw)

    monkeypatch.setattr(placement, "decide", decide)
    monkeypatch.setattr(defaults, "DECIDE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(defaults, "REVIEW_DECIDE_TIMEOUT_S", 0.5)
    yield stop
    stop.set()


def request(name: str) -> placement.Request:
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": name, "namespace": "ns"}, "spec": {"model": QWEN7}})
    return placement.request_from_object(obj, catalog.model(QWEN7))


async def test_a_decision_past_its_limit_is_rejected_and_the_loop_kept_running(spinning: threading.Event) -> None:
    ledger = placement.Ledger([placement.node_from_object(node("gpu-a", gpus=1), catalog.gpu_for_label)])
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    workers = Workers()  # the threads of one operator's Store
    d = await bounded.decide(workers, ledger, request(SLOW))
    ticker.cancel()
    assert d.phase == "Rejected" and "took more than 0.5 s" in d.message and d.reasons == (d.message,)
    assert workers.abandoned == 1
    assert ticks > 10  # the event loop ran while the thread spun
    assert ledger.deployments() == []
    fine = await bounded.decide(workers, ledger, request("fine"))  # other decisions still work meanwhile
    assert fine.admitted


async def test_the_operator_rejects_a_spec_too_costly_to_decide(spinning: threading.Event, cluster: Cluster,
                                                               operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd(SLOW, QWEN7))
    await cluster.create(vd("quick", QWEN7, maxModelLen=8192))
    st = await cluster.phase(SLOW, "Rejected")
    assert "took more than 0.5 s" in st["reasons"][0]
    assert (await cluster.phase("quick", "Admitted"))["node"] == "gpu-a"
    await cluster.until(lambda: [e for e in cluster.events(SLOW) if "took more than" in e["message"]])


async def test_the_webhook_denies_a_spec_too_costly_to_decide(spinning: threading.Event) -> None:
    from vllmfit.operator.booking.state import Store

    store = Store()
    store.rebuild([node("gpu-a", gpus=1)], [])
    # with a node selection, so that it is decided on a review thread: a spec whose decision is a few
    # bisections whatever the cluster (placement.quick) is decided on the event loop
    body = vd(SLOW, QWEN7, placement={"nodeSelector": {"kubernetes.io/hostname": "gpu-a"}})
    v = await webhook.review(store, body, None, "CREATE", False)
    assert not v.allowed and v.code == 422 and "took more than 0.5 s" in v.message
    assert (await webhook.review(store, vd("fine", QWEN7), None, "CREATE", False)).allowed
    # the review took no lock (it decided on the committed snapshot); the abandoned worker keeps
    # its namespace's place until it ends, then gives it back
    assert not store.books.lock.locked()
    adm = webhook.Admission(per_namespace=1)
    first = asyncio.create_task(webhook.review(store, body, None, "CREATE", False, adm))
    v = await first
    assert not v.allowed and adm._deciding == {"default": 1}
    spinning.set()
    for _ in range(500):  # the worker ends in a moment; its done-callback runs on the loop
        if not adm._deciding:
            break
        await asyncio.sleep(0.01)
    assert adm._deciding == {}
