"""The webhook over real HTTPS: a Kopf operator (KMock as its API server) serving both admission
handlers with certificates from certs.py, the client trusting only the caBundle the operator
injected into the ValidatingWebhookConfiguration, posting AdmissionReview v1 requests as
kube-apiserver does.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import re
import ssl
import time
from pathlib import Path

import httpx
import jsonpatch
import jsonschema
import kopf
import pytest
import yaml
from webhook_harness import H100, FakeStore, Harness, admission_review, gfd_node, parser, vllmd

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.memory import fmt_gib
from vllmfit.core.spec import api
from vllmfit.operator.admission import certs, webhook
from vllmfit.sources import catalog

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"
CRD = Path(__file__).resolve().parents[2] / "crds" / "vllmdeployments.vllmfit.dev.yaml"
NODES = [gfd_node("gpu-node-a", 1), gfd_node("gpu-node-b", 1)]


@pytest.fixture(scope="module")
def server():
    with Harness(FakeStore(NODES)) as h:
        yield h


@pytest.fixture
def hook(server):
    """The server with a fresh two-GPU ledger, and a keep-alive client trusting the injected CA."""
    server.store.books.ledger = FakeStore(NODES).books.ledger
    server.run(_set_ready(server.store, True))
    with httpx.Client(base_url=server.url, verify=server.ssl_context(), timeout=10) as c:
        server.client = c
        yield server


async def _set_ready(store, ready: bool) -> None:
    store.books.ready.set() if ready else store.books.ready.clear()


def post(h, path: str, review) -> dict:
    r = h.client.post(path, json=review)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["kind"] == "AdmissionReview" and body["apiVersion"] == "admission.k8s.io/v1"
    return body["response"]


def validate(h, obj, **kw) -> dict:
    review = admission_review(obj, **kw)
    resp = post(h, f"/{webhook.VALIDATE_ID}", review)
    assert resp["uid"] == review["request"]["uid"]
    return resp


def usage(led: placement.Ledger) -> dict:
    return {(s.node, s.index): led.used_bytes(s.node, s.index) for s in led.slots()}


def request(obj: dict) -> placement.Request:
    o = api.VLLMDeployment.model_validate(obj)
    return placement.request_from_object(o, catalog.model(o.spec.model))


# --- TLS ----------------------------------------------------------------------------------------


def test_the_served_certificate_is_trusted_through_the_injected_ca_bundle_only(hook):
    secret_ca = base64.b64decode(hook.secret()["data"]["ca.crt"])
    assert hook.ca_pem() == secret_ca
    mwc = hook.config("mutating")["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(mwc) == secret_ca
    other = ssl.create_default_context(cadata=certs.generate("x", "y").ca_crt.decode())
    with pytest.raises(httpx.ConnectError), httpx.Client(verify=other) as c:
        c.post(f"{hook.url}/{webhook.VALIDATE_ID}", json={})


# --- validate -----------------------------------------------------------------------------------


def test_a_spec_that_fits_is_allowed(hook):
    resp = validate(hook, vllmd("small", model=MODEL_8B, maxModelLen=8192))
    assert resp["allowed"] is True and "warnings" not in resp and "status" not in resp


def test_a_reduced_context_is_admitted_with_a_warning(hook):
    resp = validate(hook, vllmd("auto", model=MODEL_8B, kvCache={"concurrency": 8}))
    assert resp["allowed"] is True
    assert any(w.startswith("context reduced from 131072 to") for w in resp["warnings"])


def test_a_spec_that_fits_nowhere_is_denied_with_per_gpu_numbers_and_a_fix(hook):
    spec = {"model": MODEL_8B, "maxModelLen": 131072, "kvCache": {"concurrency": 64}}
    resp = validate(hook, vllmd("huge", **spec))
    gpu = catalog.gpu(H100)
    req = request(vllmd("huge", **spec))
    need = memory.size(req.model, placement.settings_from_spec(req.spec), gpu, 1 << 50).footprint.total
    budget = memory.DEFAULT_POLICY.budget(gpu.cuda_total_bytes)
    assert resp["allowed"] is False
    status = resp["status"]
    assert (status["code"], status["reason"]) == (403, "Forbidden")
    # grouped like the kube-scheduler: both nodes, one cause, the best candidate's numbers (N may be
    # a lower bound, never more)
    m = re.match(rf"0/2 nodes are available: 2 GPU memory \(needs (?:at least )?([\d.]+) GiB, "
                 rf"largest budget left {re.escape(fmt_gib(budget))} on gpu-node-a GPU 0\)\.", status["message"])
    assert m, status["message"]
    assert budget / GIB < float(m[1]) <= round(need / GIB, 1)
    # fewer requests of the same length first (issue 24): as many full 131072-token requests as the
    # largest KV request that fits holds
    fits = re.search(r"Fits with: kvCache\.concurrency: (\d+); or kvCache: \{tokens: (\d+)\}", status["message"])
    assert fits, status["message"]
    assert int(fits[1]) == int(fits[2]) // 131072 >= 1


def test_an_invalid_spec_is_denied_naming_the_field(hook):
    resp = validate(hook, vllmd("bad", model=MODEL_8B, tensorParallelSize="two"))
    assert resp["allowed"] is False and resp["status"]["code"] == 422 and resp["status"]["reason"] == "Invalid"
    assert resp["status"]["message"].startswith("spec.tensorParallelSize: ")


def test_an_unknown_model_is_denied_with_the_resolvers_message(hook):
    resp = validate(hook, vllmd("typo", model="meta-llama/Llama-3.1-8B-Instrukt"))
    assert resp["allowed"] is False and resp["status"]["code"] == 422
    assert "unknown model" in resp["status"]["message"] and MODEL_8B in resp["status"]["message"]


def test_dry_run_answers_would_it_fit_and_books_nothing(hook):
    before = usage(hook.store.books.ledger)
    resp = validate(hook, vllmd("probe", model=MODEL_8B, maxModelLen=8192), dry_run=True)
    assert resp["allowed"] is True
    assert any(w.startswith("dry run: would be placed on gpu-node-a GPU [0] with --max-model-len=8192")
               for w in resp["warnings"])
    no = validate(hook, vllmd("probe", model=MODEL_8B, maxModelLen=131072, kvCache={"concurrency": 64}), dry_run=True)
    assert no["allowed"] is False
    assert usage(hook.store.books.ledger) == before and hook.store.books.ledger.deployments() == []


def test_before_the_ledger_is_ready_a_spec_is_refused_saying_so(hook):
    hook.run(_set_ready(hook.store, False))
    resp = validate(hook, vllmd("early", model=MODEL_8B, maxModelLen=8192))
    assert resp["allowed"] is False and resp["status"]["code"] == 429 and resp["status"]["message"] == webhook.NOT_READY
    assert "retry in a few seconds" in webhook.NOT_READY
    assert validate(hook, vllmd("early", model=MODEL_8B, replicas=-1))["status"]["code"] == 422  # still parsed


def test_an_exception_in_the_handler_is_a_denial_with_a_message(hook):
    hook.store.books.ledger = None  # decide() will fail inside the handler
    resp = validate(hook, vllmd("boom", model=MODEL_8B, maxModelLen=8192))
    assert resp["allowed"] is False and resp["status"]["code"] == 400
    assert resp["status"]["message"].startswith("vllmfit webhook error: AttributeError")


# --- updates ------------------------------------------------------------------------------------


def admit(h, obj: dict) -> None:
    """What the operator does after admission: decide and book."""
    d = placement.decide(h.store.books.ledger, request(obj))
    assert d.admitted
    h.store.books.ledger.book(d)


def test_updates_are_rechecked_with_their_own_allocation_released(hook):
    old = vllmd("a", model=MODEL_8B, maxModelLen=32768, placement={"nodeName": "gpu-node-a"})
    admit(hook, old)
    admit(hook, vllmd("b", model=MODEL_8B, maxModelLen=32768, placement={"nodeName": "gpu-node-b"}))
    grown = copy.deepcopy(old)
    grown["spec"]["maxModelLen"] = 40960  # 57.6 GiB: fits only in the room `a` already holds
    assert validate(hook, grown, operation="UPDATE", old=old)["allowed"] is True
    too_big = copy.deepcopy(old)
    too_big["spec"].update(maxModelLen=65536, kvCache={"concurrency": 8})
    assert validate(hook, too_big, operation="UPDATE", old=old)["allowed"] is False


def test_metadata_only_updates_are_never_rechecked(hook):
    stored = vllmd("x", model=MODEL_8B, maxModelLen=131072, kvCache={"concurrency": 64})  # does not fit
    finalized = copy.deepcopy(stored)
    finalized["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    assert validate(hook, finalized, operation="UPDATE", old=stored)["allowed"] is True
    relabelled = copy.deepcopy(stored)
    relabelled["spec"]["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    assert validate(hook, relabelled, operation="UPDATE", old=stored)["allowed"] is True


# --- advisory -----------------------------------------------------------------------------------


def test_two_reviews_at_once_both_pass_and_the_operators_booking_decides(hook):
    """docs/webhook.md, 'Advisory': the webhook never reserves; the operator's serialized booking
    is authoritative and marks the later deployment Unschedulable."""
    hook.store.books.ledger = FakeStore([gfd_node("gpu-node-a", 1)]).books.ledger  # room for one of them
    a = vllmd("a", model=MODEL_8B, maxModelLen=32768, kvCache={"concurrency": 8})
    b = vllmd("b", model=MODEL_8B, maxModelLen=32768, kvCache={"concurrency": 8})

    async def both():
        async with httpx.AsyncClient(base_url=hook.url, verify=hook.ssl_context()) as c:
            return await asyncio.gather(*(c.post(f"/{webhook.VALIDATE_ID}", json=admission_review(o))
                                          for o in (a, b)))

    responses = asyncio.run(both())
    assert [r.json()["response"]["allowed"] for r in responses] == [True, True]
    assert hook.store.books.ledger.deployments() == []
    first = placement.decide(hook.store.books.ledger, request(a))
    hook.store.books.ledger.book(first)
    second = placement.decide(hook.store.books.ledger, request(b))
    assert first.phase == "Admitted" and second.phase == "Unschedulable"
    assert validate(hook, b)["allowed"] is False  # from now on the webhook sees it too


# --- mutate -------------------------------------------------------------------------------------


def crd_schema() -> dict:
    if not CRD.exists():
        pytest.skip(f"{CRD} not generated yet (`make crds`)")
    crd = next(d for d in yaml.safe_load_all(CRD.read_text()) if d)
    return next(v for v in crd["spec"]["versions"] if v["name"] == api.VERSION)["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("spec", [
    {"model": MODEL_8B},
    {"model": MODEL_8B, "placement": {"nodeName": "gpu-node-a"}, "hfTokenSecretRef": {"name": "hf"}},
])
def test_mutate_writes_the_pydantic_defaults_and_the_result_passes_the_crd_schema(hook, spec):
    obj = vllmd("m", **spec)
    resp = post(hook, f"/{webhook.MUTATE_ID}", admission_review(obj))
    assert resp["allowed"] is True and resp["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert {op["op"] for op in ops} == {"add"}
    stored = jsonpatch.apply_patch(obj, ops)
    expected = api.VLLMDeploymentSpec.model_validate(spec).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert stored["spec"] == {k: v for k, v in expected.items() if v != []}
    assert stored["spec"]["image"] == api.VLLMDeploymentSpec.model_fields["image"].default
    assert stored["metadata"]["finalizers"] == ["vllmfit.dev/finalizer"]
    jsonschema.Draft4Validator(crd_schema()).validate(stored)
    again = post(hook, f"/{webhook.MUTATE_ID}", admission_review(stored))
    assert "patch" not in again  # idempotent


def test_mutate_puts_the_finalizer_on_at_creation_only(hook):
    """A created VLLMDeployment gets vllmfit's finalizer beside the ones it has, so Kopf never
    patches it on; an update never adds it (an object being deleted may not gain finalizers)."""
    obj = vllmd("m", model=MODEL_8B)
    obj["metadata"]["finalizers"] = ["example.com/keep"]
    resp = post(hook, f"/{webhook.MUTATE_ID}", admission_review(obj))
    stored = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(resp["patch"])))
    assert stored["metadata"]["finalizers"] == ["example.com/keep", "vllmfit.dev/finalizer"]
    going = {**stored, "metadata": {**stored["metadata"], "finalizers": [],
                                    "deletionTimestamp": "2030-01-01T00:00:00Z"}}
    resp = post(hook, f"/{webhook.MUTATE_ID}", admission_review(going, operation="UPDATE", old=stored))
    ops = json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []
    assert not [op for op in ops if op["path"].startswith("/metadata")]


def test_mutate_leaves_an_invalid_spec_to_the_validator(hook):
    resp = post(hook, f"/{webhook.MUTATE_ID}", admission_review(vllmd("m", model=MODEL_8B, placement="gpu-node-a")))
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert resp["allowed"] is True and all(not op["path"].startswith("/spec/placement") for op in ops)


# --- the server itself --------------------------------------------------------------------------


def test_bad_requests_get_a_4xx_never_a_500(hook):
    c = hook.client
    assert c.post("/nowhere", json={}).status_code == 404
    assert c.post(f"/nowhere/{webhook.VALIDATE_ID}", json={}).status_code == 404  # the path, not its tail
    got = c.get(f"/{webhook.VALIDATE_ID}")
    assert got.status_code == 405 and got.headers["allow"] == "POST"
    r = c.post(f"/{webhook.VALIDATE_ID}", content=b'{"request": ')
    assert r.status_code == 400 and "not JSON" in r.json()["response"]["status"]["message"]
    review = admission_review(vllmd("x", model=MODEL_8B))
    del review["request"]["userInfo"]
    resp = post(hook, f"/{webhook.VALIDATE_ID}", review)
    assert resp["uid"] == review["request"]["uid"] and resp["allowed"] is False
    assert resp["status"] == {"code": 400, "reason": "BadRequest",
                              "message": "request.userInfo is missing or not an object"}
    review = admission_review(vllmd("x", model=MODEL_8B))
    review["request"]["resource"]["resource"] = "pods"
    resp = post(hook, f"/{webhook.VALIDATE_ID}", review)
    assert resp["allowed"] is False and "no handlers" in resp["status"]["message"]


def test_cert_manager_mode_serves_the_mounted_files_touches_no_secret_and_reloads_them(tmp_path):
    bundle = certs.generate("vllmfit-webhook", "vllmfit-system")
    certs.write(bundle, tmp_path)

    def answer(h, ca: bytes) -> dict:
        with httpx.Client(verify=ssl.create_default_context(cadata=ca.decode())) as c:
            return c.post(f"{h.url}/{webhook.VALIDATE_ID}", json=admission_review(vllmd("a", model=MODEL_8B))).json()

    with Harness(FakeStore(NODES), ["--cert-dir", str(tmp_path)], file_check_interval=0.1) as h:
        assert answer(h, bundle.ca_crt)["response"]["allowed"] is True
        assert h.secret() is None
        assert "caBundle" not in h.config("validating")["webhooks"][0]["clientConfig"]
        renewed = certs.generate("vllmfit-webhook", "vllmfit-system")  # cert-manager renews in place
        certs.write(renewed, tmp_path)
        for _ in range(50):  # Kopf re-reads the files every file_check_interval (60 s by default)
            try:
                assert answer(h, renewed.ca_crt)["response"]["allowed"] is True
                break
            except httpx.TransportError:  # the old certificate, or the listener restarting
                time.sleep(0.1)
        else:
            pytest.fail("the renewed certificate was not served")


def test_no_webhook_registers_nothing():
    settings, registry = kopf.OperatorSettings(), kopf.OperatorRegistry()
    webhook.setup(settings, parser().parse_args(["--no-webhook"]), FakeStore(), registry=registry)
    assert settings.admission.server is None and not registry._webhooks.get_all_handlers()
    webhook.setup(settings, parser().parse_args([]), FakeStore(), registry=registry)
    assert isinstance(settings.admission.server, webhook.Server)
    assert sorted(h.id for h in registry._webhooks.get_all_handlers()) == [webhook.MUTATE_ID, webhook.VALIDATE_ID]


def test_the_operators_store_and_default_image(tmp_path):
    """The real vllmfit.operator.booking.state.Store behind the webhook, and --default-image in the patch."""
    state = pytest.importorskip("vllmfit.operator.booking.state")
    store = state.Store()
    store.books.ledger = FakeStore(NODES).books.ledger
    store.books.publish()  # the writer changed it: commit
    store.books.ready.set()
    with Harness(store, ["--default-image", "registry.local/vllm:v0.9.2"]) as h, \
            httpx.Client(base_url=h.url, verify=h.ssl_context()) as c:
        h.client = c
        mutated = post(h, f"/{webhook.MUTATE_ID}", admission_review(vllmd("m", model=MODEL_8B)))
        ops = json.loads(base64.b64decode(mutated["patch"]))
        assert {"op": "add", "path": "/spec/image", "value": "registry.local/vllm:v0.9.2"} in ops
        assert validate(h, vllmd("ok", model=MODEL_8B, maxModelLen=8192))["allowed"] is True
        bad = validate(h, vllmd("typo", model="llama-3.1-8b-instrukt"))
        assert bad["allowed"] is False and bad["status"]["code"] == 422 and "unknown model" in bad["status"]["message"]


def scale_review(name: str, replicas: int, old_replicas: int) -> dict:
    """An UPDATE of vllmdeployments/NAME/scale as kube-apiserver sends it for `kubectl scale` or
    an HPA: the objects are autoscaling/v1 Scale, the subResource is "scale"."""
    def scale(n: int) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": "default"}, "spec": {"replicas": n},
                "status": {"replicas": old_replicas, "selector": f"vllmfit.dev/deployment={name}"}}

    review = admission_review(scale(replicas), operation="UPDATE", old=scale(old_replicas))
    req = review["request"]
    req["subResource"] = "scale"
    req["kind"] = req["requestKind"] = {"group": "autoscaling", "version": "v1", "kind": "Scale"}
    return review


def test_kubectl_scale_is_reviewed_like_a_spec_change(hook):
    """Two one-GPU nodes; 'big' holds one H100 with a replica nothing else fits next to."""
    from types import SimpleNamespace

    spec = {"model": MODEL_8B, "maxModelLen": 8192, "gpuMemoryUtilization": 0.6, "replicas": 1}  # > half a GPU
    obj = vllmd("big", **spec)
    d = placement.decide(hook.store.books.ledger, request(obj))
    assert d.admitted
    hook.store.books.ledger.book(d)
    obj["status"] = {"phase": "Admitted", "flags": {"maxModelLen": d.flags.max_model_len,
                                                    "maxNumSeqs": d.flags.max_num_seqs,
                                                    "gpuMemoryUtilization": d.flags.gpu_memory_utilization}}
    hook.store.cache.records["default/big"] = SimpleNamespace(body=obj)
    try:
        # 2 replicas: the other node's GPU takes the second one
        assert post(hook, f"/{webhook.VALIDATE_ID}", scale_review("big", 2, 1))["allowed"] is True
        # 3 replicas: no GPU left for the third; denied with the grouped reason
        resp = post(hook, f"/{webhook.VALIDATE_ID}", scale_review("big", 3, 1))
        assert resp["allowed"] is False and resp["status"]["code"] == 403
        assert "2/3 replicas placed; replica 2: 0/2 nodes are available: " in resp["status"]["message"]
        # shrinking always succeeds
        assert post(hook, f"/{webhook.VALIDATE_ID}", scale_review("big", 0, 1))["allowed"] is True
        # an object the operator has not seen yet: allowed, the operator checks
        resp = post(hook, f"/{webhook.VALIDATE_ID}", scale_review("unknown", 5, 1))
        assert resp["allowed"] is True and "the operator will check" in resp["warnings"][0]
    finally:
        hook.store.cache.records.clear()
        hook.store.books.ledger.release("default/big")
