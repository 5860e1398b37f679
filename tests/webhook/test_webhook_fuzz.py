"""Fuzzing the running webhook over HTTPS with hypothesis.

- Specs: every field either plausible or any JSON value (wrong types, huge numbers, NaN, unicode,
  lone surrogates), unicode names, CREATE or UPDATE, dry run or not; posted to both webhooks.
- Bodies: random bytes, truncated reviews, reviews with a field deleted or replaced by any JSON.

Whatever comes in: no 5xx, the server keeps answering, every answer is an AdmissionReview (or a
400 for a body that is not JSON), every denial has a 4xx code and a message, and every mutation
patch applies to the object it was made for. The counts are printed at the end of the run.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import httpx
import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webhook_harness import FUZZ_COUNTS, FakeStore, Harness, admission_review, gfd_node

from vllmfit.core.spec import api
from vllmfit.operator.admission import webhook
from vllmfit.sources import catalog

EXAMPLES = int(os.environ.get("VLLMFIT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
)
anything = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                        max_leaves=10)
small_int = st.integers(min_value=-2, max_value=70)
plausible: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(sorted(catalog.models())[:12] + ["", "nope/model"]),
    "image": st.sampled_from(["vllm/vllm-openai:v0.8.5", "vllm/vllm-openai:latest", "x:y"]),
    "dtype": st.sampled_from(["auto", "bfloat16", "float16", "float32", "int4"]),
    "quantization": st.sampled_from(["fp8", "awq", "gptq", "w8a8", "bogus"]),
    "kvCacheDtype": st.sampled_from(["auto", "fp8", "fp8_e5m2"]),
    "tensorParallelSize": small_int, "pipelineParallelSize": small_int, "replicas": small_int,
    "maxModelLen": st.integers(min_value=0, max_value=2**21), "maxNumSeqs": st.integers(min_value=0, max_value=512),
    "maxNumBatchedTokens": st.integers(min_value=0, max_value=2**20),
    "gpuMemoryUtilization": st.floats(min_value=-0.5, max_value=1.5), "enforceEager": st.booleans(),
    "kvCache": st.fixed_dictionaries({}, optional={  # the KV request (issue 12): odd values and conflicts
        "tokens": st.integers(min_value=-1, max_value=2**40),
        "memory": st.one_of(st.sampled_from(["20Gi", "1.5G", "0", "-1Gi", "lots", "1e40", "1Ei"]),
                            st.integers(min_value=-1, max_value=2**62)),
        "concurrency": st.integers(min_value=-1, max_value=10**6),
        "typicalLength": st.integers(min_value=-1, max_value=2**22), "grow": st.booleans()}),
    "placement": st.fixed_dictionaries({}, optional={
        "nodeName": st.sampled_from(["gpu-node-a", "gpu-node-b", "missing"]),
        "gpuIndices": st.lists(st.integers(min_value=-1, max_value=9), max_size=4),
        "allowReschedule": st.booleans(), "policy": st.sampled_from(["bestFit", "spread", "x"]),
        "nodeSelector": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)}),
    "modelParams": st.integers(min_value=-1, max_value=2**50),
    "modelConfigRef": st.fixed_dictionaries({"name": st.text(max_size=20)}),
    "hfTokenSecretRef": st.fixed_dictionaries({"name": st.text(max_size=20)}, optional={"key": st.text()}),
    "env": st.lists(st.fixed_dictionaries({"name": st.text(max_size=10), "value": st.text(max_size=10)}), max_size=2),
    "extraArgs": st.lists(st.text(max_size=20), max_size=3),
    "resources": st.dictionaries(st.sampled_from(["limits", "requests"]), st.just({"cpu": "1"})),
}

aliases = [f.alias or n for n, f in api.VLLMDeploymentSpec.model_fields.items()] + ["unknownField"]
# half the specs are plausible (values of the right type, often in range: they reach placement),
# half wild (any field may be any JSON value, or the spec itself is not an object)
spec = st.one_of(
    st.fixed_dictionaries({"model": plausible["model"]}, optional={a: p for a, p in plausible.items() if a != "model"}),
    st.one_of(st.fixed_dictionaries({}, optional={a: st.one_of(plausible.get(a, anything), anything) for a in aliases}),
              anything),
)
metadata = st.fixed_dictionaries({"name": st.text(max_size=300)}, optional={
    "namespace": st.text(max_size=70), "generateName": st.text(max_size=20), "uid": st.text(max_size=40),
    "labels": st.one_of(st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=3), anything),
    "deletionTimestamp": st.just("2026-01-01T00:00:00Z")})
obj = st.fixed_dictionaries({"apiVersion": st.just(f"{api.GROUP}/{api.VERSION}"), "kind": st.just(api.KIND),
                             "metadata": metadata, "spec": spec})


@pytest.fixture(scope="module")
def server():
    with Harness(FakeStore([gfd_node("gpu-node-a", 8), gfd_node("gpu-node-b", 2, "NVIDIA-A10G")])) as h, \
            httpx.Client(base_url=h.url, verify=h.ssl_context(), timeout=30) as c:
        h.client = c
        yield h


def post(h, path: str, body: bytes) -> httpx.Response:
    r = h.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    return r


def check_review(r: httpx.Response, uid: str | None = None) -> dict:
    body = r.json()
    resp = body["response"]
    assert isinstance(resp["allowed"], bool)
    if uid is not None:
        assert resp["uid"] == uid
    if not resp["allowed"]:
        assert 400 <= resp["status"]["code"] < 500
        assert isinstance(resp["status"]["message"], str) and resp["status"]["message"].strip()
    outcome = "allowed" if resp["allowed"] else f"denied {resp['status']['code']}"
    FUZZ_COUNTS["outcomes"][outcome] = FUZZ_COUNTS["outcomes"].get(outcome, 0) + 1
    return resp


@FUZZ
@given(new=obj, old=st.one_of(st.none(), obj), dry_run=st.booleans())
def test_fuzzed_specs_get_an_answer_with_a_message(server, new, old, dry_run):
    review = admission_review(new, operation="CREATE" if old is None else "UPDATE", old=old, dry_run=dry_run)
    uid = review["request"]["uid"]
    body = json.dumps(review).encode()  # allow_nan: NaN/Infinity tokens too
    check_review(post(server, f"/{webhook.VALIDATE_ID}", body), uid)
    resp = check_review(post(server, f"/{webhook.MUTATE_ID}", body), uid)
    if "patch" in resp:
        sent = json.loads(body)["request"]["object"]
        patched = jsonpatch.apply_patch(sent, json.loads(base64.b64decode(resp["patch"])))
        if isinstance(sent.get("spec"), dict):
            assert set(patched["spec"]) >= set(sent["spec"])  # only adds
        else:
            assert patched.get("spec") == sent.get("spec")
        if old is None and isinstance(sent.get("metadata"), dict) \
                and isinstance(sent["metadata"].get("finalizers", []), list):  # a creation: the finalizer, nothing else
            assert "vllmfit.dev/finalizer" in patched["metadata"]["finalizers"]
            assert {k: v for k, v in patched["metadata"].items() if k != "finalizers"} == \
                {k: v for k, v in sent["metadata"].items() if k != "finalizers"}
    FUZZ_COUNTS["specs"] += 1
    FUZZ_COUNTS["requests"] += 2


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


VALID = admission_review({"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
                          "metadata": {"name": "a", "namespace": "default"},
                          "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "placement": {"nodeName": "x"}}},
                         operation="UPDATE", old={"metadata": {"name": "a"}, "spec": {"model": "x"}}, uid="u-1")


@st.composite
def broken_review(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "truncated", "delete", "replace", "any"]))
    text = json.dumps(VALID)
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))].encode()
    if kind == "any":
        return json.dumps(draw(anything)).encode()
    review = json.loads(text)
    path = draw(st.sampled_from(paths(review)))
    parent = review
    for p in path[:-1]:
        parent = parent[p]
    if kind == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(anything)
    return json.dumps(review).encode()


@FUZZ
@given(body=broken_review(), hook=st.sampled_from([webhook.VALIDATE_ID, webhook.MUTATE_ID]))
def test_malformed_reviews_get_a_4xx_or_a_denial_never_a_500(server, body, hook):
    r = post(server, f"/{hook}", body)
    if r.status_code == 400:
        assert r.json()["response"]["status"]["message"]
        FUZZ_COUNTS["outcomes"]["HTTP 400"] = FUZZ_COUNTS["outcomes"].get("HTTP 400", 0) + 1
    else:
        assert r.status_code == 200
        check_review(r)
    FUZZ_COUNTS["bodies"] += 1
    FUZZ_COUNTS["requests"] += 1


def test_the_server_still_answers_after_the_fuzzing(server):
    r = post(server, f"/{webhook.VALIDATE_ID}", json.dumps(VALID).encode())
    assert check_review(r, "u-1")["allowed"] in (True, False)
