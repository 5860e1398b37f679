"""Issue 32: the operator's writes whose answer it does not use (a replica's Deployment, its
Service, a status) are not deserialised into the Kubernetes client's models (booking.report.unread),
most of the client's CPU per write; a failed write still raises ApiException, as the client does.
Its requests do not go through a thread twice each (the client's session trusting the environment:
~/.netrc and proxy lookups per request) unless the environment names a proxy."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, ApiException
from opkit import DEPLOYMENTS, SERVICES, Cluster, Operator, node, vd

from vllmfit.operator.booking import report

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"


async def test_admitting_writes_its_deployment_and_service_without_deserialising_them(
        cluster: Cluster, operator: Operator, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: list[str] = []
    real = ApiClient.deserialize

    def counted(self: ApiClient, response: Any, response_type: Any) -> Any:
        kinds.append(str(response_type))
        return real(self, response, response_type)

    monkeypatch.setattr(ApiClient, "deserialize", counted)
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(SERVICES, "a"))
    assert "V1Deployment" not in kinds and "V1Service" not in kinds, kinds


class Answer:
    """The client's raw (aiohttp) answer, as _preload_content=False returns it."""

    def __init__(self, status: int, data: bytes) -> None:
        self.status, self.reason, self.data, self.headers = status, "Conflict", data, {}

    async def read(self) -> bytes:
        return self.data


async def test_a_failed_unread_write_raises_as_the_client_does() -> None:
    sent: list[tuple[Any, ...]] = []

    async def write(*args: Any, **kwargs: Any) -> Answer:
        sent.append((args, kwargs))
        return Answer(409, b'{"reason": "AlreadyExists"}')

    with pytest.raises(ApiException) as e:
        await report.unread(write, "default", {"metadata": {"name": "a"}})
    assert (e.value.status, e.value.body) == (409, '{"reason": "AlreadyExists"}')
    assert sent == [(("default", {"metadata": {"name": "a"}}), {"_preload_content": False})]

    async def fine(*args: Any, **kwargs: Any) -> Answer:
        return Answer(201, b"{}")

    assert await report.unread(fine) is None


async def test_the_operators_client_looks_up_no_netrc_or_proxy_per_request(operator: Operator) -> None:
    assert operator.store.api.rest_client.pool_manager.trust_env is False


async def test_with_a_proxy_in_the_environment_the_client_still_trusts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes_asyncio import client

    from vllmfit.operator.handlers.startup import api_client

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    api = api_client(client.Configuration(host="https://127.0.0.1:6443"))
    try:
        assert api.rest_client.pool_manager.trust_env is True
    finally:
        await api.close()


async def test_the_operator_collects_its_youngest_and_oldest_objects_less_often(operator: Operator) -> None:
    import gc

    from vllmfit.operator.handlers.startup import GC_OLD, GC_YOUNG

    assert gc.get_threshold()[0] == GC_YOUNG > 700  # Python's default: 700
    assert gc.get_threshold()[2] == GC_OLD > 10  # Python's default: 10


async def test_the_operators_client_sends_its_json_as_it_is(operator: Operator) -> None:
    """The bodies the operator writes are JSON already: its client sends them without rebuilding
    them (kubernetes_asyncio's own client copies each one, object by object), and the API gets
    the same document."""
    from kubernetes_asyncio import client

    body = {"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {"replicas": 2, "paused": False,
                                                                       "ports": [{"port": 8000}]}}
    assert operator.store.api.sanitize_for_serialization(body) is body
    assert client.ApiClient.sanitize_for_serialization(operator.store.api, body) == body  # what it would have sent
