"""The operator's listings (start-up, resync, taking the lead) come a page at a time
(defaults.LIST_PAGE, as client-go's pager does), each page trimmed to what the operator reads of
it before the next is asked for: a listing of 5,000 VLLMDeployments' Deployments was held whole,
pod templates and all, and was the largest thing the operator held while it resynced."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client import ApiException
from opkit import Cluster, Operator, node

from vllmfit.core import defaults
from vllmfit.operator.handlers import sweep
from vllmfit.operator.rendering import builders


def child(i: int) -> dict[str, Any]:
    labels = {builders.MANAGED_BY: "vllmfit", builders.LABEL_DEPLOYMENT: f"d{i:02d}", builders.LABEL_REPLICA: "0"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": f"d{i:02d}-0", "namespace": "default", "labels": labels,
                         "annotations": {builders.ANNOTATION_PLACEMENT: "n1:0"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm", "args": ["x"] * 50}]}}}}


class Api:
    """An API client's listing call that answers from `objects` a page at a time, recording
    each request's `limit` and continue token; `expire`: the continue tokens it answers 410 to."""

    def __init__(self, objects: list[dict[str, Any]], expire: tuple[str, ...] = ()) -> None:
        self.objects, self.expire, self.asked = objects, expire, []

    async def __call__(self, *, limit: int | None = None, _continue: str | None = None,
                       _preload_content: bool = False) -> Any:
        import json

        self.asked.append((limit, _continue))
        if _continue in self.expire:
            self.expire = ()
            raise ApiException(status=410, reason="Expired")
        start = int(_continue or 0)
        page = self.objects[start:start + limit] if limit else self.objects
        more = limit is not None and start + limit < len(self.objects)
        body = {"items": page, "metadata": {"continue": str(start + limit) if more else None}}
        return Answer(json.dumps(body).encode())


class Answer:
    status = 200

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self) -> bytes:
        return self.data


async def test_a_listing_is_taken_a_page_at_a_time_and_trimmed() -> None:
    objects = [child(i) for i in range(2 * defaults.LIST_PAGE + 1)]
    call = Api(objects)
    items = await sweep.paged(call, read=sweep.child_read)
    assert call.asked == [(defaults.LIST_PAGE, None), (defaults.LIST_PAGE, str(defaults.LIST_PAGE)),
                          (defaults.LIST_PAGE, str(2 * defaults.LIST_PAGE))]
    assert [o["metadata"] for o in items] == [o["metadata"] for o in objects]
    assert all(set(o) == {"metadata"} for o in items)  # no pod template kept


async def test_an_expired_continue_token_lists_again_whole() -> None:
    objects = [child(i) for i in range(defaults.LIST_PAGE + 3)]
    call = Api(objects, expire=(str(defaults.LIST_PAGE),))
    items = await sweep.paged(call, read=sweep.child_read)
    assert call.asked[-1] == (None, None)  # client-go's pager: a full listing
    assert [o["metadata"]["name"] for o in items] == [o["metadata"]["name"] for o in objects]


async def test_another_error_is_raised() -> None:
    class Failing(Api):
        async def __call__(self, **_: Any) -> Any:
            raise ApiException(status=500, reason="Boom")

    with pytest.raises(ApiException):
        await sweep.paged(Failing([]), read=sweep.child_read)


async def test_a_listing_is_abandoned_between_pages_when_asked() -> None:
    objects = [child(i) for i in range(2 * defaults.LIST_PAGE + 1)]
    call, pages = Api(objects), []
    with pytest.raises(sweep.Abandoned):
        await sweep.paged(call, read=sweep.child_read, abandon=lambda: bool(pages.append(1) or len(pages) > 1))
    assert call.asked == [(defaults.LIST_PAGE, None)]  # the first page only


async def test_a_resync_stops_listing_once_anything_changed(cluster: Cluster, operator: Operator,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A resync whose listing would be thrown away (the ledger changed meanwhile: a burst of
    creates) stops at the next page: it asked for every page of every listing before (at
    40,000 VLLMDeployments on 10,000 nodes, a hundred pages asked and thrown away each time)."""
    from vllmfit.operator.handlers import startup

    for i in range(7):
        await cluster.create(node(f"gpu-{i}", gpus=1))
    store = operator.store
    await cluster.until(lambda: len(store.books.ledger.nodes) == 7, what="the nodes")
    monkeypatch.setattr(defaults, "LIST_PAGE", 3)
    node_read = sweep.node_read

    def read_while_it_changes(obj: dict[str, Any]) -> dict[str, Any]:
        store.books.changes += 1  # a change committed while the first page is read
        return node_read(obj)

    monkeypatch.setattr(sweep, "node_read", read_while_it_changes)
    before = len(cluster.km.sent("get", "v1/nodes")), len(cluster.km.sent("get", "vllmfit.dev/v1alpha1/vllmdeployments"))
    assert await startup.resync_once(store) is False
    after = len(cluster.km.sent("get", "v1/nodes")), len(cluster.km.sent("get", "vllmfit.dev/v1alpha1/vllmdeployments"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)  # one page of nodes; no VLLMDeployment


def test_what_is_kept_of_a_pod_and_a_node() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "b"}, "managedFields": [{}],
                        "ownerReferences": [{"uid": "o", "controller": True}]},
           "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Running", "conditions": [{}]}}
    assert sweep.pod_read(pod) == {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "b"},
                                                "ownerReferences": [{"uid": "o", "controller": True}]},
                                   "status": {"phase": "Running"}}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "labels": {"x": "y"}, "managedFields": [{}]},
            "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}, "status": {"images": [{"names": ["i"]}]}}
    assert sweep.node_read(node) == {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "labels": {"x": "y"}},
                                     "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}


async def test_the_emulator_pages_the_operators_listing(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real client and the emulator: the resync's listing of vllmfit's Deployments,
    three to a page, is every one of them."""
    from kubernetes_asyncio import client

    monkeypatch.setattr(defaults, "LIST_PAGE", 3)
    apps = client.AppsV1Api(cluster.api)
    for i in range(8):
        await apps.create_namespaced_deployment("default", child(i))
    items = await sweep.paged(apps.list_deployment_for_all_namespaces, label_selector=builders.selector(),
                              read=sweep.child_read)
    assert sorted(o["metadata"]["name"] for o in items) == [f"d{i:02d}-0" for i in range(8)]
    lists = [r for r in cluster.km.sent("get", "apps/v1/deployments")]
    assert len(lists) == 3


def test_a_listed_vllmdeployment_shares_what_its_record_shows() -> None:
    """The resync's listing of VLLMDeployments keeps a listed status and spec only where they
    differ from the record's: where the record shows them, the record's own objects stand in
    (one copy per deployment, not two, while a resync holds the listing: 700 MiB at 40,000)."""
    from vllmfit.operator.booking.record import kept_body
    from vllmfit.operator.booking.state import Store

    store = Store()
    spec = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "maxModelLen": 4096}
    written = {"phase": "Admitted", "placement": [{"replica": 0, "node": "n1", "gpus": [{"index": 0}]}]}

    def listed(status: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment", "spec": dict(spec),
                "metadata": {"name": "a", "namespace": "default", "managedFields": [{"manager": "x"}]},
                "status": {**status, "observedGeneration": None}}  # a null the API may keep: still what it shows

    read = sweep.vllmdeployment_read(store)
    alone = read(listed(written, spec))  # no record: kept as listed, less managedFields
    assert alone["status"]["phase"] == "Admitted" and "managedFields" not in alone["metadata"]
    rec = store.cache.upsert(kept_body(listed(written, spec)))
    rec.written = dict(written)
    same = read(listed(written, spec))
    assert same["status"] is rec.written and same["spec"] is rec.body["spec"]
    other = read(listed({**written, "phase": "Running"}, {**spec, "maxModelLen": 8192}))
    assert other["status"]["phase"] == "Running" and other["status"] is not rec.written
    assert other["spec"]["maxModelLen"] == 8192 and other["spec"] is not rec.body["spec"]
