"""The operator's identity on the API server: its Events are reported by "vllmfit" (what
`kubectl describe` shows under From, and `kubectl get events` under SOURCE) and name the pod that
posted them; every request it makes, Kopf's included, carries the User-Agent vllmfit/<version>,
from which the API server takes the field manager of non-apply writes."""

from __future__ import annotations

from typing import Any

import pytest
from opkit import TEST_AGENT, VD, Cluster, Operator, node, vd

from vllmfit import __version__

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time


@pytest.fixture
def pod_name(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("POD_NAME", "vllmfit-operator-7d9c-x1q")
    return "vllmfit-operator-7d9c-x1q"


async def test_events_are_from_vllmfit_and_name_the_pod(km: Any, cluster: Cluster, pod_name: str,
                                                          operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("huge", "Qwen/Qwen2.5-72B-Instruct"))
    event = await cluster.event("huge", "Unschedulable")
    assert event["source"] == {"component": "vllmfit"}
    assert (event["reportingComponent"], event["reportingInstance"]) == ("vllmfit", pod_name)
    assert event["metadata"]["generateName"] == "vllmfit-"
    assert event["involvedObject"]["name"] == "huge" and event["type"] == "Warning"


async def test_every_request_of_the_operator_says_vllmfit(km: Any, cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("llama", "Qwen/Qwen2.5-7B-Instruct"))
    await cluster.phase("llama", "Admitted")
    await cluster.until(lambda: cluster.events("llama"), what="an Event about llama")
    agents = {r.headers.get("User-Agent") for r in km.journal} - {TEST_AGENT}
    assert agents == {f"vllmfit/{__version__}"}
    # both clients were heard: Kopf's (watches, its finalizer) and the operator's (status)
    assert km.sent("watch", VD) and any(r.headers.get("User-Agent") != TEST_AGENT and "status" in (r.data or {})
                                        for r in km.sent("patch", VD))
