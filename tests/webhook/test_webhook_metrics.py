"""The webhook's latency histogram by outcome (vllmfit_webhook_duration_seconds), counted over
real HTTPS reviews: one allowed, one allowed with a warning, one denied (does not fit), one
invalid; the mutating webhook's one review counted as `default`/`allowed`."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import REGISTRY
from webhook_harness import FakeStore, Harness, admission_review, gfd_node, vllmd

from vllmfit.operator import metrics
from vllmfit.operator.admission import webhook

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def server():
    # observed by the metrics, as `vllmfit operator` sets it up (operator/main.py)
    with Harness(FakeStore([gfd_node("gpu-node-a", 1)]), observer=metrics.observe_review) as h:
        yield h


def count(hook: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("vllmfit_webhook_duration_seconds_count",
                                     {"webhook": hook, "outcome": outcome}) or 0.0


def test_each_review_is_counted_once_under_its_outcome(server) -> None:
    outcomes = [("validate", o) for o in metrics.OUTCOMES] + [("default", "allowed")]
    before = {k: count(*k) for k in outcomes}
    cases = [
        ("allowed", vllmd("small", model=MODEL_8B, maxModelLen=8192)),
        ("warned", vllmd("auto", model=MODEL_8B, kvCache={"concurrency": 8})),
        ("denied", vllmd("huge", model=MODEL_8B, maxModelLen=131072, kvCache={"concurrency": 64})),
        ("invalid", vllmd("bad", model=MODEL_8B, tensorParallelSize="two")),
    ]
    with httpx.Client(base_url=server.url, verify=server.ssl_context(), timeout=10) as c:
        for outcome, obj in cases:
            resp = c.post(f"/{webhook.VALIDATE_ID}", json=admission_review(obj)).json()["response"]
            assert resp["allowed"] is (outcome in ("allowed", "warned")), (outcome, resp)
            assert ("warnings" in resp) is (outcome == "warned"), (outcome, resp)
        c.post(f"/{webhook.MUTATE_ID}", json=admission_review(vllmd("small", model=MODEL_8B)))
    after = {k: count(*k) for k in outcomes}
    expected = {**{k: 0.0 for k in outcomes}, **{("validate", o): 1.0 for o, _ in cases}, ("default", "allowed"): 1.0}
    assert {k: after[k] - before[k] for k in outcomes} == expected
    # the time is the review's own: positive and far under the API server's 5 s timeout
    total = REGISTRY.get_sample_value("vllmfit_webhook_duration_seconds_sum", {"webhook": "validate",
                                                                               "outcome": "denied"})
    assert total is not None and 0 < total < 5
