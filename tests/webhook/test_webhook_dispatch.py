"""The server answers reviews itself (webhook.Reviewer.answer), not through Kopf's per-request
dispatch, which cost more than the review (issue 32: 0.8 ms of CPU per review at 1,000 nodes).
The same reviews through both must get the same AdmissionReview response: the same verdict, code,
message and warnings, and a mutation patch that stores the same object. And a small spec that fits
is decided on the event loop, everything else on a review thread, with the same verdict as the
full `check`."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webhook_harness import FakeStore, Harness, admission_review, gfd_node, vllmd

from vllmfit.core import defaults, placement
from vllmfit.core.spec import api, read
from vllmfit.operator.admission import webhook
from vllmfit.sources import catalog

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"
MODEL_1B = "Qwen/Qwen2.5-1.5B-Instruct"
MODEL_405B = "meta-llama/Llama-3.1-405B-Instruct"
NODES = [gfd_node("gpu-node-a", 1), gfd_node("gpu-node-b", 2)]


def _scale(name: str, replicas: int, old: int) -> dict:
    def obj(n: int) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "default"},
                "spec": {"replicas": n}, "status": {"replicas": old}}
    review = admission_review(obj(replicas), operation="UPDATE", old=obj(old))
    review["request"]["subResource"] = "scale"
    return review


def _status(obj: dict) -> dict:
    review = admission_review(obj, operation="UPDATE", old=obj)
    review["request"]["subResource"] = "status"
    return review


def _update(old: dict, **spec) -> dict:
    new = {**old, "spec": {**old["spec"], **spec}}
    return admission_review(new, operation="UPDATE", old=old)


FITS = vllmd("fits", model=MODEL_8B, maxModelLen=8192, maxNumSeqs=4)
VALIDATE = {
    "fits": admission_review(FITS),
    "dry run": admission_review(vllmd("dry", model=MODEL_1B, maxModelLen=4096), dry_run=True),
    "fits nowhere": admission_review(vllmd("big", model=MODEL_405B, maxModelLen=8192)),
    "too many replicas": admission_review(vllmd("many", model=MODEL_8B, maxModelLen=8192, replicas=9)),
    "pinned elsewhere": admission_review(vllmd("pin", model=MODEL_8B, maxModelLen=8192, tensorParallelSize=2,
                                               placement={"nodeName": "gpu-node-a"})),
    "invalid": admission_review(vllmd("bad", model=MODEL_8B, maxModelLen=-1)),
    "unknown model": admission_review(vllmd("typo", model="llama-3.1-8b-instrukt")),
    "tenant field": admission_review(vllmd("pt", model=MODEL_8B, podTemplate={"spec": {"hostNetwork": True}})),
    "metadata-only update": admission_review({**FITS, "metadata": {**FITS["metadata"], "labels": {"a": "b"}}},
                                             operation="UPDATE", old=FITS),
    "spec update": _update(FITS, maxModelLen=4096),
    "scale": _scale("unknown", 3, 1),
    "status": _status(FITS),
}
MUTATE = {
    "minimal": admission_review(vllmd("m", model=MODEL_8B)),
    "nested partly set": admission_review(vllmd("n", model=MODEL_8B, placement={"nodeName": "gpu-node-a"},
                                                kvCache={"concurrency": 4}, hfTokenSecretRef={"name": "hf"})),
    "everything set": admission_review(vllmd("e", **{
        k: v for k, v in api.VLLMDeploymentSpec.model_validate({"model": MODEL_8B}).model_dump(
            mode="json", by_alias=True, exclude_none=True).items() if v != []})),
    "spec not an object": admission_review({**vllmd("s", model=MODEL_8B), "spec": "x"}),
    "invalid nested": admission_review(vllmd("i", model=MODEL_8B, placement="gpu-node-a")),
    "scale": _scale("m", 2, 1),
}


@pytest.fixture(scope="module")
def server():
    with Harness(FakeStore(NODES), ["--default-image", "registry.local/vllm:v1"]) as h, \
            httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=10) as c:
        h.client = c
        yield h


def both(h, path: str, review: dict) -> tuple[dict, dict]:
    """The response from the server's own answer, then from Kopf's dispatch."""
    answer = h.server.answer
    out = []
    try:
        for a in (answer, None):
            h.server.answer = a
            r = h.client.post(path, json=review)
            assert r.status_code == 200, r.text
            out.append(r.json())
    finally:
        h.server.answer = answer
    return out[0], out[1]


@pytest.mark.parametrize("case", VALIDATE)
def test_validating_answers_equal_kopfs_dispatch(server, case):
    ours, kopfs = both(server, f"/{webhook.VALIDATE_ID}", VALIDATE[case])
    assert ours == kopfs


@pytest.mark.parametrize("case", MUTATE)
def test_mutating_patches_store_what_kopfs_dispatch_stores(server, case):
    review = MUTATE[case]
    ours, kopfs = both(server, f"/{webhook.MUTATE_ID}", review)

    def stored(answer: dict) -> object:
        r = answer["response"]
        if "patch" not in r:
            return review["request"]["object"]
        assert r["patchType"] == "JSONPatch"
        return jsonpatch.apply_patch(review["request"]["object"], json.loads(base64.b64decode(r["patch"])))

    assert stored(ours) == stored(kopfs)
    assert ({k: v for k, v in ours["response"].items() if k != "patch"}
            == {k: v for k, v in kopfs["response"].items() if k != "patch"})
    if case == "minimal":
        assert stored(ours)["spec"]["image"] == "registry.local/vllm:v1"


def test_requests_the_configurations_never_send_are_allowed_or_denied_without_a_review(server):
    review = admission_review(FITS, operation="DELETE", old=FITS)
    review["request"]["object"] = None
    assert server.client.post(f"/{webhook.VALIDATE_ID}", json=review).json()["response"] == {
        "uid": review["request"]["uid"], "allowed": True}
    review = admission_review(FITS)
    review["request"]["resource"]["resource"] = "pods"
    r = server.client.post(f"/{webhook.VALIDATE_ID}", json=review).json()["response"]
    assert r["allowed"] is False and r["status"]["code"] == 400 and "no handlers" in r["status"]["message"]


# --- where the decision runs --------------------------------------------------------------------


class CountingWorkers:
    """Store.workers, counting the decisions sent to a review thread."""

    def __init__(self, workers) -> None:
        self.workers, self.sent = workers, 0

    def review(self):
        self.sent += 1
        return self.workers.review()

    def __getattr__(self, name):
        return getattr(self.workers, name)


SPECS = st.fixed_dictionaries({
    "model": st.sampled_from([MODEL_8B, MODEL_1B, MODEL_405B]),
    "maxModelLen": st.sampled_from([2048, 8192, 32768]),
    "replicas": st.integers(1, 6),
}, optional={"maxNumSeqs": st.sampled_from([1, 4, 64]), "tensorParallelSize": st.sampled_from([1, 2]),
             "kvCache": st.fixed_dictionaries({"concurrency": st.integers(1, 16)}),
             "placement": st.fixed_dictionaries({"nodeSelector": st.fixed_dictionaries(
                 {"nvidia.com/gpu.product": st.sampled_from(["NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"])})})})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(booked=st.lists(SPECS, max_size=4), spec=SPECS, dry_run=st.booleans())
def test_a_review_decided_on_the_loop_equals_the_full_check(booked, spec, dry_run):
    """Whatever the ledger and the spec, `review` gives exactly the verdict of the full `check`
    (fixes and all), and sends to a thread only what does not fit or has many replicas."""
    store = FakeStore([gfd_node("gpu-node-a", 2), gfd_node("gpu-node-b", 4), gfd_node("gpu-node-c", 1, "NVIDIA-L4")])
    store.workers = CountingWorkers(store.workers)
    for i, b in enumerate(booked):
        obj = read.deployment(vllmd(f"b{i}", **b))
        d = placement.decide(store.books.ledger, placement.request_from_object(obj, catalog.model(obj.spec.model)))
        if d.admitted:
            store.books.ledger.book(d)
    body = vllmd("new", **spec)
    obj = read.deployment(body)
    req = placement.request_from_object(obj, catalog.model(obj.spec.model))
    expected = webhook.check(store.books.snapshot(), req, dry_run=dry_run)
    got = asyncio.run(webhook.review(store, body, None, "CREATE", dry_run))
    assert got == expected
    inline = (spec["replicas"] <= defaults.REVIEW_INLINE_REPLICAS and "placement" not in spec
              and (expected.allowed or expected.code == 422))
    assert store.workers.sent == (0 if inline else 1)


def test_a_refusal_found_on_the_loop_is_decided_again_with_its_fixes_on_a_thread():
    store = FakeStore([gfd_node("gpu-node-a", 1)])
    store.workers = CountingWorkers(store.workers)
    body = vllmd("big", model=MODEL_8B, maxModelLen=131072, kvCache={"concurrency": 64})
    v = asyncio.run(webhook.review(store, body, None, "CREATE", False))
    assert not v.allowed and v.code == 403 and "Fits with" in v.message and store.workers.sent == 1


def test_quick_means_a_few_bisections_whatever_the_cluster():
    """placement.quick: few replicas, every node a candidate, and at most 16 nodes that may refuse
    the pods (a search steps past each one's GPUs)."""
    def cordoned(name: str) -> dict:
        return {**gfd_node(name, 8), "spec": {"unschedulable": True}}

    def req(**spec) -> placement.Request:
        obj = read.deployment(vllmd("q", model=MODEL_8B, **spec))
        return placement.request_from_object(obj, catalog.model(MODEL_8B))

    few = FakeStore([gfd_node("a", 8), *(cordoned(f"c{i:02d}") for i in range(16))]).books.snapshot()
    many = FakeStore([gfd_node("a", 8), *(cordoned(f"c{i:02d}") for i in range(17))]).books.snapshot()
    assert placement.quick(few, req(), 4) and placement.quick(few, req(replicas=4), 4)
    assert not placement.quick(few, req(replicas=5), 4)
    assert not placement.quick(few, req(placement={"nodeSelector": {"pool": "a"}}), 4)
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]}}}
    assert not placement.quick(few, req(podTemplate={"spec": {"affinity": affinity}}), 4)
    assert not placement.quick(many, req(), 4)
