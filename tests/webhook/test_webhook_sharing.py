"""Issue 33 through the webhook: the same example files as `vllmfit plan`
(tests/placement/test_share_by_default.py) and the operator (tests/operator/test_sharing.py),
reviewed one by one as kube-apiserver sends them, each admitted one booked as the operator books
it, in their order and in reverse. Every review allows what the plan admits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from webhook_harness import FakeStore

from vllmfit.core import memory, placement
from vllmfit.core.spec import api, read
from vllmfit.main import main
from vllmfit.operator.admission import webhook

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sharing"


def documents(name: str) -> tuple[list[dict], list[dict]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return [d for d in docs if d["kind"] == "Node"], [d for d in docs if d["kind"] == api.KIND]


def planned(capsys, name: str, *args: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    main(["plan", "-f", str(EXAMPLES / name), "-o", "json", *args])
    out = json.loads(capsys.readouterr().out)
    return {d["name"]: (d["replicas"][0]["node"], tuple(d["replicas"][0]["gpus"]), d["kv_cache"]["granted_tokens"])
            for d in out["deployments"] if d["phase"] == "Admitted"}


async def review_all(store: FakeStore, deployments: list[dict]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Each spec reviewed (CREATE), then booked as the operator books an admitted spec."""
    out = {}
    for body in deployments:
        v = await webhook.review(store, body, None, "CREATE", False)
        assert v.allowed, v.message
        req = await store.request_for(read.deployment(body))
        d = placement.decide(store.books.ledger, req)
        store.books.ledger.book(d)
        r = d.replicas[0]
        out[req.key] = (r.node, r.gpus, r.sizing.granted_tokens)
    return out


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("example", ["six-small.yaml", "mixed.yaml", "six-llama-1b.yaml", "four-small.yaml",
                                     "eight-qwen-15b.yaml"])
def test_the_webhook_admits_what_plan_admits(capsys, example, reverse):
    nodes, deployments = documents(example)
    got = asyncio.run(review_all(FakeStore(nodes), deployments[::-1] if reverse else deployments))
    assert set(got) == set(planned(capsys, example))
    assert len(got) == len(deployments)
    on = [where[:2] for where in got.values()]
    assert max(on.count(g) for g in on) >= 4  # shared: at least four on one GPU


def test_the_clusters_default_grant_reaches_the_webhook(capsys):
    """A spec with neither kvCache nor maxNumSeqs: a fair share under `requests` (the default; its
    footprint grows to 1/8 of the budget, more than its request of 2 x 1024, less than its limit,
    vLLM's default maxNumSeqs 1024 x 1024), the limit under `room` (the room holds it); the webhook's
    ledger carries the choice, as the operator's does (--default-kv-grant)."""
    nodes, deployments = documents("six-small.yaml")
    bodies = [{**b, "spec": {k: v for k, v in b["spec"].items() if k != "maxNumSeqs"}} for b in deployments]
    store = FakeStore(nodes)
    got = asyncio.run(review_all(store, bodies[:1]))
    [tokens] = [t for *_, t in got.values()]
    assert 2 * 1024 < tokens < 1024 * 1024
    [key] = got
    budget = store.books.ledger.slot("gpu-h100-s", 0).budget_bytes
    assert store.books.ledger.bookings_of(key)[0].footprint.total <= budget // 8
    store = FakeStore(nodes)
    store.books.ledger.kv_grant = memory.KvGrant("room")
    got = asyncio.run(review_all(store, bodies[:1]))
    assert [t for *_, t in got.values()] == [1024 * 1024]


def test_the_webhook_names_neighbours_holding_room_beyond_their_caps_first():
    """Two 0.5B servers admitted under the old rule hold the room of both H100s (their statuses,
    without grantedBy or requestBytes, restored as the operator restores them): a third is denied,
    and the first fix of the denial names the neighbour, how much it holds beyond maxNumSeqs x
    maxModelLen and the change that gives it back (its caps as kvCache.concurrency)."""
    from vllmfit.sources import catalog

    nodes, deployments = documents("six-small.yaml")
    store = FakeStore(nodes)
    h100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    model = catalog.model("Qwen/Qwen2.5-0.5B-Instruct")
    grown = memory.size(model, memory.Settings(max_model_len=1024, max_num_seqs=4, kv_grow=True), h100,
                        memory.DEFAULT_POLICY.budget(h100.cuda_total_bytes))
    fp, f = grown.footprint, grown.flags
    for i in range(2):
        st = api.VLLMDeploymentStatus.model_validate({
            "phase": "Admitted",
            "flags": {"maxModelLen": 1024, "maxNumSeqs": 4, "gpuMemoryUtilization": f.gpu_memory_utilization},
            "kvCache": {"bytes": fp.kv_cache, "tokens": grown.granted_tokens,
                        "concurrencyAtMaxModelLen": round(grown.max_concurrency, 2)},
            "memory": [{"node": "gpu-h100-s", "index": i, "weightsBytes": fp.weights, "kvCacheBytes": fp.kv_cache,
                        "activationBytes": fp.activation, "overheadBytes": fp.overhead, "totalBytes": fp.total}]})
        store.books.ledger.restore(f"old/chat-{i}", placement.bookings_from_status(f"old/chat-{i}", st))
    v = asyncio.run(webhook.review(store, deployments[0], None, "CREATE", False))
    assert not v.allowed
    fixes = v.message.split("Fits with: ", 1)[1]
    assert fixes.startswith("neighbours on gpu-h100-s GPU 0 hold KV cache above their requests (old/chat-0 67.9 GiB): "
                            "set kvCache.concurrency: 4 on old/chat-0")  # the room of an H100, less its caps
    assert fixes.index("neighbours on") < fixes.index("budget policy")
