"""The KV request and the budget policy through placement: node-pool labels, the cluster-wide policy,
the refusal that names the policy, a KV request no GPU can hold, and a hypothesis property: a granted
KV cache is never smaller than the request and no GPU is booked past its policy's budget."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, LLAMA_8B, QWEN_05B, QWEN_7B, check_invariant, node, request

from vllmfit.core import defaults, memory, placement
from vllmfit.sources import catalog

GIB = 1 << 30


def _gfd(name: str, product: str, count: int, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": {defaults.GFD_PRODUCT_LABEL: product,
                                                  defaults.GFD_COUNT_LABEL: str(count), **labels}}}


def test_node_pool_labels_override_the_cluster_policy() -> None:
    cluster = memory.BudgetPolicy(0.8, 4 * GIB, "cluster")
    plain = placement.node_from_object(_gfd("a", "NVIDIA-H100-80GB-HBM3", 1), catalog.gpu_for_label, policy=cluster)
    pool = placement.node_from_object(
        _gfd("b", "NVIDIA-H100-80GB-HBM3", 1, **{defaults.BUDGET_UTILIZATION_LABEL: "0.95",
                                                 defaults.BUDGET_RESERVE_LABEL: "512Mi"}),
        catalog.gpu_for_label, policy=cluster)
    half = placement.node_from_object(
        _gfd("c", "NVIDIA-H100-80GB-HBM3", 1, **{defaults.BUDGET_RESERVE_LABEL: "1Gi"}),
        catalog.gpu_for_label, policy=cluster)
    T = H100.cuda_total_bytes
    ctx = int(0.55 * GIB)  # counted: a lone vLLM's CUDA context, kept by every utilization and reserve
    assert plain.gpus[0].budget_bytes == math.ceil(0.8 * T) + ctx - 4 * GIB
    assert pool.gpus[0].budget_bytes == math.ceil(0.95 * T) + ctx - 512 * (1 << 20)
    assert half.gpus[0].budget_bytes == math.ceil(0.8 * T) + ctx - GIB  # the utilization still comes from the cluster
    assert pool.gpus[0].policy.source == "node pool label" and pool.error is None


def test_an_invalid_label_makes_the_node_take_nothing_and_say_why() -> None:
    bad = placement.node_from_object(
        _gfd("bad", "NVIDIA-H100-80GB-HBM3", 1, **{defaults.BUDGET_UTILIZATION_LABEL: "1.5"}), catalog.gpu_for_label)
    big = placement.node_from_object(
        _gfd("big", "NVIDIA-L4", 1, **{defaults.BUDGET_RESERVE_LABEL: "100Gi"}), catalog.gpu_for_label)
    assert bad.gpus[0].budget_bytes == 0 and "outside [0, 1]" in (bad.error or "")
    assert "larger than the GPU" in (big.error or "")
    ledger = placement.Ledger([bad, big])
    d = placement.decide(ledger, request("d", QWEN_05B, maxModelLen=4096))
    assert d.phase == "Unschedulable"
    assert "node(s) refused by their budget policy:" in d.message and "outside [0, 1]" in d.message


def test_a_refusal_names_the_policy_and_what_it_holds_back() -> None:
    tight = memory.BudgetPolicy(0.5, 8 * GIB, "cluster")
    ledger = placement.Ledger([node("n", H100, 1, policy=tight)])
    d = placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=32768, kvCache={"concurrency": 8}))
    held = H100.cuda_total_bytes - (math.ceil(0.5 * H100.cuda_total_bytes) + int(0.55 * GIB) - 8 * GIB)
    # 19.5 GiB short, less than the 47.1 GiB the policy holds back: the policy is a cause, so it is named
    assert f"Budget policy (cluster) ceil(0.5 x capacity) + 0.55 GiB CUDA context - 8.0 GiB (custom) holds back " \
           f"{memory.fmt_gib(held)} of each NVIDIA-H100-80GB-HBM3." in d.message


def test_a_kv_request_no_gpu_can_hold_is_one_line_with_the_largest_that_fits() -> None:
    ledger = placement.Ledger([node("a", H100, 2), node("b", A100_40, 1)])
    d = placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=8192, kvCache={"tokens": 5_000_000}))
    assert d.phase == "Rejected" and "\n" not in d.message
    assert "kvCache.tokens 5000000 is more than any GPU can hold" in d.message
    largest = int(d.message.split("the largest that fits is kvCache.tokens ")[1].split()[0])
    ok = placement.decide(ledger, request("e", LLAMA_8B, maxModelLen=8192, kvCache={"tokens": largest}))
    assert ok.admitted and ok.replicas[0].sizing.granted_tokens >= largest
    more = placement.decide(ledger, request("f", LLAMA_8B, maxModelLen=8192, kvCache={"tokens": largest + 16}))
    assert not more.admitted


def test_status_shows_what_was_granted() -> None:
    from vllmfit.operator.booking import report

    ledger = placement.Ledger([node("n", H100, 1)])
    d = placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=16384,
                                         kvCache={"concurrency": 64, "typicalLength": 2048}))
    st = report.kv_status(d)
    assert st is not None and st.bytes == (64 * 128 + 1) * 16 * 131_072
    assert st.tokens == 64 * 2048 and st.concurrency_at_typical_length == 64.0
    assert st.concurrency_at_max_model_len == 8.0 and st.typical_length == 2048


# --- property ---------------------------------------------------------------------------------

MODELS = (QWEN_05B, LLAMA_8B, QWEN_7B)
kv_st = st.one_of(
    st.builds(lambda t: {"tokens": t}, st.integers(1, 400_000)),
    st.builds(lambda m: {"memory": f"{m}Mi"}, st.integers(64, 40_000)),
    st.builds(lambda c, t: {"concurrency": c, "typicalLength": t}, st.integers(1, 128), st.sampled_from([256, 1024, 4096])),
    st.builds(lambda c: {"concurrency": c}, st.integers(1, 16)),
    st.just({}),
    st.builds(lambda t: {"tokens": t, "grow": True}, st.integers(1, 100_000)),
)
req_st = st.tuples(st.sampled_from(range(3)), st.sampled_from([4096, 8192, 16384]), kv_st,
                   st.sampled_from(["vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.21.0", "vllm/vllm-openai:v0.33.0"]))
policy_st = st.builds(memory.BudgetPolicy, st.floats(0.5, 1.0), st.integers(0, 8 * GIB), st.just("cluster"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(req_st, min_size=1, max_size=6), policy_st, st.sampled_from([H100, A100_40]))
def test_granted_kv_is_never_below_the_request_and_no_gpu_passes_its_budget(reqs, policy, gpu) -> None:
    reqs_ = [request(f"d{i}", MODELS[m], f"{i:02d}", maxModelLen=length, kvCache=kv, image=image)
             for i, (m, length, kv, image) in enumerate(reqs)]
    p = placement.plan([node("n", gpu, 2, policy=policy)], reqs_)
    check_invariant(p.ledger)  # bookings + foreign <= the policy's budget on every GPU
    for sl in p.ledger.slots():
        assert p.ledger.used_bytes(sl.node, sl.index) <= policy.budget(gpu.cuda_total_bytes) or \
            not p.ledger.bookings_on(sl.node, sl.index)
    for r in reqs_:
        d = p.decisions[r.key]
        if not d.admitted:
            continue
        kv = r.spec.kv_cache
        for rep in d.replicas:
            z = rep.sizing
            assert z.flags.kv_cache_memory_bytes == z.footprint.kv_cache  # injected as granted
            if kv.tokens is not None:
                assert z.granted_tokens >= kv.tokens
            if kv.memory is not None:
                assert z.footprint.kv_cache >= kv.memory_bytes
            if kv.concurrency is not None and kv.typical_length is not None:
                assert z.concurrency_typical >= kv.concurrency
            if kv.concurrency is not None and kv.typical_length is None:
                assert z.max_concurrency >= kv.concurrency
            assert z.max_concurrency >= 1  # at least one full-length request, always


def test_an_explicit_utilization_the_policy_refuses_gets_checked_fixes_on_the_ledger() -> None:
    """gpuMemoryUtilization 0.92 on an empty H100: ctx + ceil(0.92 T) > ceil(0.9 T) + ctx (counted; vLLM's
    own 0.9 is admitted). The fix names the utilization that fits (re-placed on the ledger) and the
    policy that admits it."""
    ledger = placement.Ledger([node("n", H100, 1)])
    assert placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=8192, gpuMemoryUtilization=0.9)).admitted
    d = placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=8192, gpuMemoryUtilization=0.92))
    assert d.phase == "Unschedulable"
    u = next(s for s in d.suggestions if s.startswith("gpuMemoryUtilization: "))
    fixed = placement.decide(ledger, request("d", LLAMA_8B, maxModelLen=8192,
                                             gpuMemoryUtilization=float(u.split(": ")[1])))
    assert fixed.admitted
    policy = next(s for s in d.suggestions if s.startswith("budget policy utilization "))
    want = float(policy.split()[3])
    ctx = fixed.replicas[0].sizing.footprint.cuda_context
    T = H100.cuda_total_bytes
    assert ctx + math.ceil(T * 0.92) <= memory.BudgetPolicy(want).budget(T)
    assert want == 0.92 and memory.BudgetPolicy(0.91).budget(T) < ctx + math.ceil(T * 0.92)
    roomier = placement.Ledger([node("n", H100, 1, policy=memory.BudgetPolicy(want, 0, "cluster"))])
    assert placement.decide(roomier, request("d", LLAMA_8B, maxModelLen=8192, gpuMemoryUtilization=0.92)).admitted
