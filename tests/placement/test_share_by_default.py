"""Issue 33: no deployment is granted more KV cache than it can use, so ordinary specs share GPUs.

The examples are the issue's cases, run through `vllmfit plan` here (tests/webhook/test_webhook_sharing.py
and tests/operator/test_sharing.py run the same files through the webhook and the operator). Values
are checked by hand: Qwen2.5-0.5B holds 24 layers x 2 KV heads x (64 + 64) x 2 B = 12,288 B per
token, a block of 16 tokens is 196,608 B; Llama-3.1-8B 131,072 B per token (2 MiB blocks);
Qwen2.5-7B 57,344 B per token (917,504 B blocks); vLLM 0.33 adds one null block.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllmfit.core import memory
from vllmfit.main import main
from vllmfit.sources import catalog

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def plan_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "-o", "json"])
    return code, json.loads(capsys.readouterr().out)


def placed_on(d: dict) -> tuple[str, int]:
    r = d["replicas"][0]
    return r["node"], r["gpus"][0]


def test_six_small_deployments_share_one_h100(capsys):
    """Six Qwen2.5-0.5B at maxModelLen 1024, maxNumSeqs 4, no kvCache, on one node with two H100s:
    all admitted, all on one GPU, each granted 4 x 1024 = 4,096 tokens = 4 x 64 blocks + the null
    block = 257 x 196,608 B = 50,528,256 B (main granted the room: 2 admitted, 5,891,712 tokens each)."""
    code, d = plan_json(capsys, "-f", str(EXAMPLES / "sharing" / "six-small.yaml"))
    deps = d["deployments"]
    assert code == 0 and len(deps) == 6 and all(x["phase"] == "Admitted" for x in deps)
    assert len({placed_on(x) for x in deps}) == 1
    for x in deps:
        assert x["per_gpu"]["kv_cache_bytes"] == 257 * 196_608 == 50_528_256
        assert x["kv_cache"]["granted_tokens"] == 4 * 1024
        assert x["kv_cache"]["granted_by"] == "maxNumSeqs 4 x maxModelLen 1024"
        assert x["flags"]["max_num_seqs"] == 4 and x["flags"]["kv_cache_memory_bytes"] == 50_528_256
    code, room = plan_json(capsys, "-f", str(EXAMPLES / "sharing" / "six-small.yaml"), "--default-kv-grant", "room")
    assert room["deployments"] == deps  # maxNumSeqs is set: the cluster's rule does not apply


def test_fourteen_mixed_deployments_share_two_h100s_and_an_l4(capsys):
    """The 14-deployment mix (0.5B, 1.5B, Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B, each with its own
    caps): all admitted, at least four on one GPU, each granted between its request (2 full-length
    requests, at most maxNumSeqs) and its limit maxNumSeqs x maxModelLen. The 8B and 7B servers keep
    their requests: a fair share (1/8 of an H100's budget, 8.98 GiB) is below their weights (it was
    exactly the limit before the fair share)."""
    code, d = plan_json(capsys, "-f", str(EXAMPLES / "sharing" / "mixed.yaml"))
    deps = {x["name"]: x for x in d["deployments"]}
    assert code == 0 and len(deps) == 14 and all(x["phase"] == "Admitted" for x in deps.values())
    per_gpu = Counter(placed_on(x) for x in deps.values())
    assert max(per_gpu.values()) >= 4 and len(per_gpu) == 3
    for x in deps.values():
        f, kv = x["flags"], x["kv_cache"]
        assert kv["request_tokens"] == min(2, f["max_num_seqs"]) * f["max_model_len"]
        assert kv["limit_tokens"] == f["max_num_seqs"] * f["max_model_len"]
        assert kv["request_tokens"] <= kv["granted_tokens"] <= kv["limit_tokens"]
    # by hand: Llama-3.1-8B, the request 2 x 8192 = 2 x 512 blocks + null = 1025 x 2 MiB
    assert deps["apps/llama8b-a"]["per_gpu"]["kv_cache_bytes"] == 1025 * 2 * 1024 * 1024 == 2_149_580_800
    assert deps["apps/llama8b-a"]["kv_cache"]["granted_by"] == "default request: 2 x maxModelLen 8192"
    # Qwen2.5-7B, 2 x 16384 = 2 x 1024 blocks + null = 2049 x 917,504 B
    assert deps["apps/qwen7b-b"]["per_gpu"]["kv_cache_bytes"] == 2049 * 917_504 == 1_879_965_696


def test_the_text_plan_says_which_rule_granted_what(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["plan", "-f", str(EXAMPLES / "sharing" / "six-small.yaml")])
    out = capsys.readouterr().out
    assert code == 0 and out.count("KV grant: 4,096 tokens (maxNumSeqs 4 x maxModelLen 1024)") == 6


# --- the property: a default grant never exceeds maxNumSeqs x maxModelLen ------------------------

MODELS = sorted(m for m in catalog.models() if not catalog.models()[m].pooling)
GPUS = sorted(catalog.gpus())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    length=st.sampled_from([None, 256, 1000, 1024, 4096, 8192, 32768]),
    seqs=st.sampled_from([None, 1, 2, 3, 4, 16, 64, 300]),
    rule=st.sampled_from(["requests", "room"]),
    requests=st.integers(1, 64),
    share=st.floats(0.05, 1.0),
    unlimited=st.booleans(),
)
def test_a_spec_without_kv_cache_is_never_granted_more_than_its_caps(model, gpu, length, seqs, rule, requests,
                                                                     share, unlimited):
    """For every spec without kvCache, on any GPU with any room left: the KV bytes are at most
    maxNumSeqs x blocks(maxModelLen) + the null block (whole blocks per request, per KV group, as
    vLLM pages them), with the flags it runs (the effective maxNumSeqs, vLLM's default when unset);
    for a model with one full-attention KV group, the tokens granted are at most maxNumSeqs x
    maxModelLen rounded up to whole blocks. And never less than one full-length request."""
    m, g = catalog.model(model), catalog.gpu(gpu)
    if length is not None and length > m.max_model_len:
        length = m.max_model_len
    s = memory.default_grant(memory.Settings(max_model_len=length, max_num_seqs=seqs), memory.KvGrant(rule, requests))
    budget = memory.DEFAULT_POLICY.budget(g.cuda_total_bytes)
    try:
        z = memory.size(m, s, g, memory.UNLIMITED if unlimited else int(budget * share))
    except memory.SpecError:
        return  # this model cannot run on this GPU at all
    if not z.fits or z.flags is None:
        return
    version = memory.parse_version(s.vllm_version)[0]
    lay = memory.kv_layout(m, s, version, g)
    if not lay.block_bytes:
        return
    L, S = z.flags.max_model_len, z.flags.max_num_seqs
    batched = z.flags.max_num_batched_tokens or 0
    assert z.footprint.kv_cache <= lay.bytes_for(L, S, batched)
    assert z.footprint.kv_cache >= lay.bytes_for(L, 1, batched)
    assert z.footprint.kv_cache >= lay.bytes_for(L, min(requests, S), batched)  # its request, at least
    if lay.full_groups == 1 and lay.groups == 1:
        assert z.granted_tokens <= S * math.ceil(L / lay.block_size) * lay.block_size


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"])
@pytest.mark.parametrize("gpu", ["NVIDIA-L4", "NVIDIA-A10G", "NVIDIA-GeForce-RTX-4090"])
def test_an_8b_at_8k_on_an_empty_24gb_gpu_is_still_admitted_by_plan(capsys, tmp_path, model, gpu):
    """The sharing default never refuses what the room default admitted. One node, one GPU, one spec
    at maxModelLen 8192 with nothing else: admitted, with its grant shown, its request of 2 x 8192
    tokens (a fair share, 1/8 of the budget, is below its weights)."""
    f = tmp_path / "one.yaml"
    f.write_text(f"""
apiVersion: v1
kind: Node
metadata: {{name: n, labels: {{nvidia.com/gpu.product: {gpu}, nvidia.com/gpu.count: "1"}}}}
---
apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {{name: a, namespace: x}}
spec: {{model: {model}, maxModelLen: 8192}}
""")
    code, d = plan_json(capsys, "-f", str(f))
    x = d["deployments"][0]
    assert code == 0 and x["phase"] == "Admitted"
    assert x["kv_cache"]["granted_tokens"] == x["kv_cache"]["request_tokens"] == 2 * 8192
    assert x["kv_cache"]["granted_by"] == "default request: 2 x maxModelLen 8192"


def test_the_goldens_of_examples_without_kv_cache_hold_their_requests_by_hand():
    """The two example specs without kvCache or maxNumSeqs, checked by hand: their request is 2
    requests of 8192 tokens, and a fair share (1/8 of the budget) is below their weights, so that is
    their grant. dra-cluster's Qwen2.5-7B on an H100: 2 x 512 + 1 blocks of 917,504 B = 940,441,600 B
    (4 requests before the fair share; the room, 61,021 blocks, before that); lora-offload's
    Llama-3.1-70B, TP 1: 80 layers x 8 KV heads x 256 x 2 B = 327,680 B per token, blocks of
    5,242,880 B: 1025 x 5,242,880 = 5,373,952,000 B."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "estimate"
    qwen = json.loads((golden / "dra-cluster-qwen-7b.json").read_text())
    assert qwen["per_gpu"]["kv_cache_bytes"] == 1025 * 917_504 == 940_441_600
    assert qwen["kv_cache"]["granted_tokens"] == 2 * 8192 and qwen["flags"]["max_model_len"] == 8192
    llama = json.loads((golden / "lora-offload-llama-70b-offload.json").read_text())
    assert llama["per_gpu"]["kv_cache_bytes"] == 1025 * 16 * 80 * 8 * 256 * 2 == 5_373_952_000
    assert llama["kv_cache"]["granted_tokens"] == 2 * 8192


# --- fixes that name the cause -----------------------------------------------------------------


def _room_status(sizing: memory.Sizing, node: str, index: int, granted_by: str | None):
    """An admitted status as the operator wrote it, with the grant `sizing` holds."""
    from vllmfit.core.spec import api

    fp, f = sizing.footprint, sizing.flags
    return api.VLLMDeploymentStatus(
        phase="Admitted",
        flags=f,  # the one flag type: what sizing made is what the status carries
        kv_cache=api.KvCacheStatus(bytes=fp.kv_cache, tokens=sizing.granted_tokens, granted_by=granted_by,
                                   concurrency_at_max_model_len=round(sizing.max_concurrency, 2)),
        memory=[api.GpuMemory(node=node, index=index, weights_bytes=fp.weights, kv_cache_bytes=fp.kv_cache,
                              activation_bytes=fp.activation, overhead_bytes=fp.overhead, total_bytes=fp.total)])


@pytest.mark.parametrize("granted_by", [None, "one request of maxModelLen 1024, grown into the room left (kvCache.grow)"])
def test_a_refusal_names_the_neighbours_holding_room_beyond_their_caps_before_the_budget_policy(granted_by):
    """Two 0.5B servers (maxNumSeqs 4, maxModelLen 1024) hold the whole of their H100s: admitted before
    issue 33 (the room by default: status without grantedBy) or with kvCache.grow. They keep their
    bookings (restored from status, never re-decided), so a third is refused; the first fix names
    them and how much they hold beyond 4 x 1024 tokens (4 x 64 + 1 blocks of 196,608 B), checked by
    placing the third with those bookings trimmed, before any budget-policy change."""
    from placement_fakes import H100, QWEN_05B, node, request

    from vllmfit.core import placement

    h100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    grown = memory.size(QWEN_05B, memory.Settings(max_model_len=1024, max_num_seqs=4, kv_grow=True), h100,
                        memory.DEFAULT_POLICY.budget(h100.cuda_total_bytes))
    caps = 257 * 196_608
    assert grown.footprint.kv_cache > 1000 * caps  # the room: about 67 GiB
    admitted = {f"old/chat-{i}": placement.bookings_from_status(f"old/chat-{i}", _room_status(grown, "n", i, granted_by))
                for i in range(2)}
    for bookings in admitted.values():  # kv x (1 - 4 / concurrency), within one block of the hand figure
        assert abs(bookings[0].kv_beyond - (grown.footprint.kv_cache - caps)) <= 196_608
    new = request("new/chat", QWEN_05B, "z", maxModelLen=1024, maxNumSeqs=4)
    p = placement.plan([node("n", H100, 2)], [new], admitted=admitted)
    d = p.decisions["new/chat"]
    assert d.phase == "Unschedulable"
    first = d.suggestions[0]
    beyond = memory.fmt_gib(admitted["old/chat-0"][0].kv_beyond)
    change = "kvCache.grow: false" if granted_by else "kvCache.concurrency: 4"  # back to its caps, 4 x 1024
    assert first == (f"neighbours on n GPU 0 hold KV cache above their requests (old/chat-0 {beyond}): set "
                     f"{change} on old/chat-0 (their requests; a rolling restart), and this fits there")
    assert "Fits with: neighbours on n GPU 0" in d.message
    assert not any(s.startswith("budget policy") for s in d.suggestions[:1])
    assert p.ledger.bookings_of("old/chat-0") == admitted["old/chat-0"]  # the check left the ledger as it was


def test_a_neighbour_within_its_caps_is_never_named():
    """`plan` places every request before it grants, so a refusal in a plan names no neighbour."""
    from placement_fakes import H100, QWEN_7B, node, request

    from vllmfit.core import placement

    reqs = [request(f"a{i}", QWEN_7B, str(i), maxModelLen=32768, maxNumSeqs=16) for i in range(4)]
    p = placement.plan([node("n", H100, 1)], reqs)
    refused = [d for d in p.decisions.values() if not d.admitted]
    assert refused and not any("above their requests" in s for d in refused for s in d.suggestions)


def test_a_deployment_kept_from_its_status_shows_the_grant_its_status_names(capsys, monkeypatch, tmp_path):
    """`vllmfit status` and `plan` keep an admitted deployment's bookings from status.memory; the
    KV grant line comes from status.kvCache (tokens, grantedBy)."""
    import yaml

    monkeypatch.setenv("COLUMNS", "200")
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "sharing" / "six-small.yaml").read_text()) if d][:2]
    dep = docs[1]
    dep["status"] = {
        "phase": "Admitted",
        "flags": {"maxModelLen": 1024, "maxNumSeqs": 4, "gpuMemoryUtilization": 0.0422},
        "kvCache": {"bytes": 50_528_256, "tokens": 4096, "grantedBy": "maxNumSeqs 4 x maxModelLen 1024",
                    "concurrencyAtMaxModelLen": 4.0},
        "memory": [{"node": "gpu-h100-s", "index": 0, "weightsBytes": 1 << 30, "kvCacheBytes": 50_528_256,
                    "activationBytes": 1 << 30, "overheadBytes": 1 << 30, "totalBytes": (3 << 30) + 50_528_256}],
    }
    f = tmp_path / "kept.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    assert main(["plan", "-f", str(f)]) == 0
    out = capsys.readouterr().out
    assert "(kept: from status)" in out and "KV grant: 4,096 tokens (maxNumSeqs 4 x maxModelLen 1024)" in out
