"""A replica larger than a node: pipeline stages as vLLM splits them, placed as a gang across nodes.

Figures are computed here by hand from the models' config.json numbers (the catalog holds them);
the stage split is checked against vLLM's own `get_pp_indices` cases (tests/distributed/test_utils.py
`test_custom_layer_partition` and the default rule of vllm/distributed/utils.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from placement_fakes import H100, check_invariant, node, request

from vllmfit import main as cli
from vllmfit.core import memory, placement
from vllmfit.core.memory import Settings, split, stages
from vllmfit.core.memory.weights import stage_weights_bytes
from vllmfit.sources import catalog

DEEPSEEK = catalog.model("deepseek-ai/DeepSeek-R1")
LLAMA_405B = catalog.model("meta-llama/Llama-3.1-405B-Instruct")
QWEN_06B = catalog.model("Qwen/Qwen3-0.6B")
SMALL = {"maxModelLen": 8192, "kvCache": {"tokens": 16384}}
BIG = {"tensorParallelSize": 8, "pipelineParallelSize": 2, "maxModelLen": 32768, "kvCache": {"tokens": 131072}}


@pytest.mark.parametrize(("layers", "pp", "want"), [
    (61, 2, (31, 30)),  # DeepSeek-R1: the remainder goes to the stage before the last
    (61, 4, (15, 15, 16, 15)),
    (126, 2, (63, 63)),  # Llama-3.1-405B
    (32, 5, (6, 6, 7, 7, 6)),
    (20, 4, (5, 5, 5, 5)),
])
def test_the_default_split_is_vllms(layers: int, pp: int, want: tuple[int, ...]) -> None:
    assert split.partition(layers, pp) == want


def test_an_explicit_split_is_checked_as_vllm_checks_it() -> None:
    assert split.partition(20, 4, (4, 6, 6, 4)) == (4, 6, 6, 4)  # vLLM's test_custom_layer_partition
    with pytest.raises(ValueError, match="does not match pipelineParallelSize"):
        split.partition(20, 4, (5, 5, 10))
    with pytest.raises(ValueError, match="does not match the 20 layers"):
        split.partition(20, 4, (5, 5, 5, 6))


def test_llama_405b_stage_weights_by_hand() -> None:
    # config.json: hidden 16384, vocab 128256, 126 layers, untied LM head, bf16; TP 8 x PP 2 = 63 + 63 layers
    s = Settings(tp=8, pp=2)
    emb = 128256 * 16384
    vocab = math.ceil(128256 / (64 * 8)) * 64 * 16384 * 2  # padded to 64 x TP, one rank's share, bf16
    layers = (LLAMA_405B.params - 2 * emb) * 2 / 8 * 63 / 126
    rope = LLAMA_405B.rope_cache_elems * 2
    first, last = split.stages(LLAMA_405B, 2)
    assert stage_weights_bytes(LLAMA_405B, s, first) == int(layers + vocab + rope)  # the embedding
    assert stage_weights_bytes(LLAMA_405B, s, last) == int(layers + vocab + rope)  # the LM head
    assert f"{int(layers + vocab + rope) / 2**30:.1f}" == "47.3"


def test_deepseek_r1_stages_hold_their_own_dense_and_moe_layers() -> None:
    # config.json: 61 layers, first_k_dense_replace 3, 256 routed experts of 2048, hidden 7168,
    # intermediate 18432, vocab 129280, fp8 weights (1 byte), bf16 embeddings. PP 2: [0, 31) holds
    # the 3 dense layers and 28 MoE layers, [31, 61) 30 MoE layers.
    first, last = split.stages(DEEPSEEK, 2)
    assert (first.dense, first.moe, last.dense, last.moe) == (3, 28, 0, 30)
    s = Settings(tp=8, pp=2)
    emb = 129280 * 7168
    experts = 58 * 256 * 3 * 7168 * 2048
    dense = 3 * 7168 * 18432
    rest = DEEPSEEK.params - 2 * emb - experts - 3 * dense  # attention, shared experts, norms: per layer
    vocab = math.ceil(129280 / 512) * 64 * 7168 * 2
    rope = DEEPSEEK.rope_cache_elems * 2
    want0 = int((rest * 31 / 61 + dense * 3 + experts * 28 / 58) / 8 + vocab + rope)
    want1 = int((rest * 30 / 61 + experts * 30 / 58) / 8 + vocab + rope)
    assert stage_weights_bytes(DEEPSEEK, s, first) == want0
    assert stage_weights_bytes(DEEPSEEK, s, last) == want1
    assert want1 > want0  # the last stage is the fuller: more MoE layers
    assert memory.weights_bytes(DEEPSEEK, s) == want1


def test_each_stage_holds_the_kv_cache_of_its_own_layers() -> None:
    s = memory.default_grant(Settings(tp=8, pp=2, max_model_len=32768, kv_tokens=131072))
    z = memory.size(DEEPSEEK, s, H100, memory.UNLIMITED)
    first, last = stages.stage_footprints(DEEPSEEK, s, H100, z)
    # MLA: one latent of 512 + 64 values per token and layer, bf16, not split by TP; every rank
    # gets the same number of blocks (vLLM unifies them to the smallest), so the 30-layer stage
    # holds 30/31 of the 31-layer stage's KV pages
    page = memory.kv_layout(DEEPSEEK, s, memory.parse_version(s.vllm_version)[0], H100).block_bytes
    assert page % (31 * 576 * 2) == 0
    blocks = first.kv_cache // page
    assert first.kv_cache == z.footprint.kv_cache
    assert last.kv_cache == z.footprint.kv_cache - blocks * page // 31
    assert (first.activation, first.overhead) == (last.activation, last.overhead) == (
        z.footprint.activation, z.footprint.overhead)


@pytest.mark.parametrize(("pods", "gpus", "per_node", "tp", "stated"), [
    (2, 16, 8, 8, None), (1, 8, 8, 8, None), (4, 32, 8, 8, None), (2, 16, 8, 4, None),
    (None, 16, 8, 16, None),  # a TP group larger than a node is never split unless asked
    (4, 16, 8, 16, 4), (None, 16, 8, 8, 3), (None, 16, 4, 8, 2),
])
def test_pods_per_replica(pods: int | None, gpus: int, per_node: int, tp: int, stated: int | None) -> None:
    assert stages.pods(gpus, per_node, tp, stated) == pods


def _cluster(n: int = 4, labels: dict[str, dict[str, str]] | None = None) -> list[placement.NodeInfo]:
    return [node(f"h100-{c}", H100, 8, labels=(labels or {}).get(f"h100-{c}")) for c in "abcdefgh"[:n]]


def _small(c: str) -> placement.Request:
    return request(f"chat/qwen-{c}", QWEN_06B, order=f"0{c}", placement={"nodeName": f"h100-{c}"}, **SMALL)


def test_plan_admits_deepseek_r1_and_llama_405b_across_two_nodes_each_beside_one_node_deployments() -> None:
    reqs = [_small(c) for c in "abcd"] + [request("big/deepseek-r1", DEEPSEEK, order="1", **BIG),
                                          request("big/llama-405b", LLAMA_405B, order="2", **BIG)]
    p = placement.plan(_cluster(), reqs)
    check_invariant(p.ledger)
    assert p.ledger.over_budget() == []
    smalls = {p.decisions[f"chat/qwen-{c}"].replicas[0].node for c in "abcd"}
    assert smalls == {"h100-a", "h100-b", "h100-c", "h100-d"}
    seen: set[str] = set()
    for key, model in (("big/deepseek-r1", DEEPSEEK), ("big/llama-405b", LLAMA_405B)):
        d = p.decisions[key]
        assert d.admitted, d.message
        (r,) = d.replicas
        assert [len(m.gpus) for m in r.members] == [8, 8] and len({m.node for m in r.members}) == 2
        assert not seen & {m.node for m in r.members}  # beside the one-node deployments, not beside each other
        seen |= {m.node for m in r.members}
        books = p.ledger.bookings_of(key)
        assert len(books) == 16 and len({(b.node, b.index) for b in books}) == 16
        # the same per-GPU figures as estimate (stage k on pod k)
        code = cli.main(["estimate", "--model", model.name, "--tp", "8", "--pp", "2", "--max-model-len", "32768",
                         "--kv-cache-tokens", "131072", "-o", "json"])
        assert code == 0
    assert seen == {"h100-a", "h100-b", "h100-c", "h100-d"}


def test_estimate_and_plan_give_the_same_per_gpu_figures(capsys: pytest.CaptureFixture[str]) -> None:
    for model in (DEEPSEEK, LLAMA_405B):
        reqs = [_small(c) for c in "ab"] + [request("big/m", model, order="1", **BIG)]
        p = placement.plan(_cluster(2), reqs)
        d = p.decisions["big/m"]
        assert d.admitted, d.message
        assert cli.main(["estimate", "--model", model.name, "--tp", "8", "--pp", "2", "--max-model-len", "32768",
                         "--kv-cache-tokens", "131072", "-o", "json"]) == 0
        est = json.loads(capsys.readouterr().out)
        assert est["fits"] and est["nodes"] == 2
        for k, m in enumerate(d.replicas[0].members):
            assert {fp.total for fp in m.footprints} == {est["stages"][k]["total_bytes"]}
            assert {fp.weights for fp in m.footprints} == {est["stages"][k]["weights_bytes"]}
            assert {fp.kv_cache for fp in m.footprints} == {est["stages"][k]["kv_cache_bytes"]}


def test_the_gang_is_booked_in_one_step_and_released_whole() -> None:
    ledger = placement.Ledger(_cluster(2))
    d = placement.decide(ledger, request("big/llama", LLAMA_405B, **BIG))
    assert d.admitted and len(d.bookings()) == 16
    ledger.book(d)
    assert {b.node for b in ledger.bookings_of("big/llama")} == {"h100-a", "h100-b"}
    assert len(ledger.release("big/llama")) == 16
    assert all(ledger.headroom_bytes(sl.node, sl.index) == sl.budget_bytes for sl in ledger.slots())


def test_nodes_of_one_topology_domain() -> None:
    # a and c in zone z1, b and d in z2: the pods of one replica never mix zones
    zones = {"h100-a": "z1", "h100-b": "z2", "h100-c": "z1", "h100-d": "z2"}
    labels = {n: {"topology.kubernetes.io/zone": z} for n, z in zones.items()}
    d = placement.decide(placement.Ledger(_cluster(4, labels)), request("big/llama", LLAMA_405B, **BIG))
    assert d.admitted
    assert len({zones[m.node] for m in d.replicas[0].members}) == 1
    # three nodes, one per zone: refused, and the reasons say the nodes with room share no domain
    labels3 = {f"h100-{c}": {"topology.kubernetes.io/zone": c} for c in "abc"}
    d = placement.decide(placement.Ledger(_cluster(3, labels3)), request("big/llama", LLAMA_405B, **BIG))
    assert d.phase == "Unschedulable"
    assert any("do not share one topology domain" in r for r in d.reasons)


def test_more_nodes_than_are_free_is_refused_per_node_with_a_checked_fix() -> None:
    # Llama-3.1-405B at TP 8 x PP 4 (4 pods) on 2 nodes of 8 H100s; PP 2 fits them
    reqs = [request("big/llama", LLAMA_405B, **{**BIG, "pipelineParallelSize": 4})]
    p = placement.plan(_cluster(2), reqs)
    d = p.decisions["big/llama"]
    assert d.phase == "Unschedulable"
    assert d.reasons[0].startswith("needs 4 nodes with 8 NVIDIA-H100-80GB-HBM3 GPUs each")
    assert d.reasons[0].endswith("2 of the 2 nodes have that room")
    assert d.suggestions[0] == "pipelineParallelSize: 2"  # checked: two nodes hold it
    # one per node when a node is what refuses: fill h100-b
    reqs = [request("x/filler", catalog.model("meta-llama/Llama-3.1-70B-Instruct"), tensorParallelSize=8, maxModelLen=8192, kvCache={"tokens": 8192},
                    placement={"nodeName": "h100-b"}, order="0"),
            request("big/llama", LLAMA_405B, order="1", **BIG)]
    p = placement.plan(_cluster(2), reqs)
    d = p.decisions["big/llama"]
    assert d.phase == "Unschedulable"
    assert any(r.startswith("h100-b: 0 of its 8 NVIDIA-H100-80GB-HBM3 GPUs have") for r in d.reasons), d.reasons
    assert d.suggestions, d.message
    for fix in d.suggestions:  # each fix, applied, fits
        update = {k: (int(v) if v.isdigit() else v) for k, v in (part.split(": ") for part in fix.split(", "))}
        fixed = [reqs[0], request("big/llama", LLAMA_405B, order="1", **{**BIG, **update})]
        assert placement.plan(_cluster(2), fixed).decisions["big/llama"].admitted, fix
    first = placement.plan(_cluster(3), reqs).decisions["big/llama"]
    assert first.admitted  # a third node: fits


def test_a_pinned_or_indivisible_multi_node_spec_is_refused() -> None:
    ledger = placement.Ledger(_cluster(2))
    d = placement.decide(ledger, request("big/llama", LLAMA_405B, **{**BIG, "placement": {"nodes": 3}}))
    assert d.phase == "Rejected" and "placement.nodes 3 does not divide" in d.message


def test_plan_cli_shows_the_group_across_its_nodes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    nodes = "".join(
        f"apiVersion: v1\nkind: Node\nmetadata: {{name: h100-{n}, labels: {{nvidia.com/gpu.product: "
        f"NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.count: \"8\"}}}}\n---\n" for n in "ab")
    spec = ("apiVersion: vllmfit.dev/v1alpha1\nkind: VLLMDeployment\nmetadata: {name: ds}\nspec: {model: "
            "deepseek-ai/DeepSeek-R1, tensorParallelSize: 8, pipelineParallelSize: 2, maxModelLen: 32768, "
            "kvCache: {tokens: 131072}}\n")
    f = tmp_path / "c.yaml"
    f.write_text(nodes + spec)
    assert cli.main(["plan", "-f", str(f)]) == 0
    out = capsys.readouterr().out
    assert "on h100-a GPU 0,1,2,3,4,5,6,7 + h100-b GPU 0,1,2,3,4,5,6,7" in out or \
        "on h100-b GPU 0,1,2,3,4,5,6,7 + h100-a GPU 0,1,2,3,4,5,6,7" in out
    assert "    leader h100-" in out and "    worker 1 h100-" in out


def _stage_cases() -> list[tuple[str, int]]:
    out = []
    for name in sorted(catalog.models()):
        m = catalog.model(name)
        out += [(name, pp) for pp in (2, 3, 4) if m.num_layers >= pp and not m.pooling]
    return out


@pytest.mark.parametrize(("name", "pp"), _stage_cases())
def test_no_stage_books_more_than_the_sizing_and_the_fullest_is_it(name: str, pp: int) -> None:
    """Every catalog model at PP 2, 3, 4: the sizing (flags, fit) is the fullest stage's, so no
    stage's GPU needs more than it, and one stage's weights are the sizing's."""
    model = catalog.model(name)
    s = memory.default_grant(Settings(pp=pp, max_model_len=min(4096, model.max_model_len)))
    try:
        z = memory.size(model, s, H100, memory.UNLIMITED)
    except memory.SpecError:
        return  # a combination vLLM refuses (validation says why); nothing to book
    per_stage = stages.stage_footprints(model, s, H100, z)
    assert len(per_stage) == pp
    assert all(fp.total <= z.footprint.total and fp.kv_cache <= z.footprint.kv_cache for fp in per_stage)
    assert max(fp.weights for fp in per_stage) == z.footprint.weights
    assert all(fp.activation == z.footprint.activation and fp.overhead == z.footprint.overhead for fp in per_stage)


def test_a_replica_across_nodes_read_back_from_its_bookings_keeps_its_pods() -> None:
    """`plan` keeps an admitted deployment's bookings (status.memory) as they are: a replica across
    nodes comes back as its leader and its worker, in the order it was booked."""
    first = placement.plan(_cluster(2), [request("big/llama", LLAMA_405B, **BIG)])
    d = first.decisions["big/llama"]
    kept = placement.plan(_cluster(2), [request("big/llama", LLAMA_405B, **BIG)],
                          admitted={"big/llama": d.bookings()}).decisions["big/llama"]
    assert kept.restored and kept.admitted
    assert [(m.node, m.gpus) for m in kept.replicas[0].members] == [(m.node, m.gpus) for m in d.replicas[0].members]


def test_a_replica_across_nodes_without_kv_cache_is_placed_at_its_request_and_leaves_room() -> None:
    # no kvCache: placed by its KV request (2 requests of maxModelLen), never by its limit (vLLM's
    # default maxNumSeqs x maxModelLen), so a small deployment after it still finds room beside it
    big = {"tensorParallelSize": 8, "pipelineParallelSize": 2, "maxModelLen": 32768}
    p = placement.plan(_cluster(2),
                       [request("big/llama-405b", LLAMA_405B, order="1", **big),
                        request("chat/qwen", QWEN_06B, order="2", maxModelLen=8192)])
    d = p.decisions["big/llama-405b"]
    assert d.admitted, d.message
    assert p.decisions["chat/qwen"].admitted, p.decisions["chat/qwen"].message
    s = memory.request_only(memory.default_grant(Settings(tp=8, pp=2, max_model_len=32768)))
    request_kv = memory.size(LLAMA_405B, s, H100, memory.UNLIMITED).footprint.kv_cache  # the request, stage 0
    assert max(b.footprint.kv_cache for b in p.ledger.bookings_of("big/llama-405b")) == request_kv
    check_invariant(p.ledger)
    assert p.ledger.over_budget() == []
