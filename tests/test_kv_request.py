"""The KV request (spec.kvCache / --kv-cache-*), the budget policy and what the GPU can run, checked by
hand calculation. Llama-3.1-8B-Instruct, bf16, TP 1: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B
per token; a 16-token block is 2,097,152 B; vLLM keeps one null block out of the pool."""

from __future__ import annotations

import contextlib
import math

import pytest
from kubernetes.utils import parse_quantity

from vllmfit import main as cli
from vllmfit.core import memory
from vllmfit.core.memory import BudgetPolicy, Settings
from vllmfit.core.quantity import parse_bytes
from vllmfit.sources import catalog

GIB = 1 << 30
H100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
T4 = catalog.gpu("Tesla-T4")
A100 = catalog.gpu("NVIDIA-A100-SXM4-80GB")
LLAMA = catalog.model("meta-llama/Llama-3.1-8B-Instruct")
BLOCK = 16 * 131_072
T = 85_031_714_816  # H100 cudaMemGetInfo total (catalog)
BUDGET = int(0.9 * T) - 2 * GIB  # ADR-0002


def size(**kw: object) -> memory.Sizing:
    return memory.size(LLAMA, Settings(**kw), H100, BUDGET)  # type: ignore[arg-type]


# --- the request forms --------------------------------------------------------------------------


def test_tokens_are_whole_blocks_plus_the_null_block() -> None:
    sz = size(max_model_len=32768, kv_tokens=40_000)
    assert sz.footprint.kv_cache == (math.ceil(40_000 / 16) + 1) * BLOCK == 5_244_977_152
    assert sz.granted_tokens == 40_000  # (2501 blocks - the null block) x 16
    assert sz.flags.kv_cache_memory_bytes == 5_244_977_152
    # 32k requests: 2048 blocks each; vLLM's logged concurrency divides every block, the null block
    # too (get_max_concurrency_for_kv_cache_config; tests/data/vllm-oracle)
    assert sz.max_concurrency == pytest.approx(2501 / 2048)


def test_memory_is_taken_as_given() -> None:
    sz = size(max_model_len=8192, kv_bytes=parse_bytes("20Gi"))
    assert sz.footprint.kv_cache == 20 * GIB
    assert sz.granted_tokens == (20 * GIB // BLOCK - 1) * 16 == 163_824
    assert f"--kv-cache-memory-bytes={20 * GIB}" in sz.flags.args()


def test_concurrency_at_a_typical_length() -> None:
    sz = size(max_model_len=16384, kv_concurrency=64, typical_len=2048)
    assert sz.footprint.kv_cache == (64 * 2048 // 16 + 1) * BLOCK == 17_181_966_336
    assert sz.concurrency_typical == pytest.approx(64.0)
    assert sz.max_concurrency == pytest.approx(8193 / 1024)  # 8193 blocks (null included) / 1024 per 16k
    assert sz.granted_tokens == 64 * 2048


def test_nothing_asked_is_one_full_length_request_and_vllms_own_max_num_seqs() -> None:
    sz = size(max_model_len=8192)
    assert sz.footprint.kv_cache == (8192 // 16 + 1) * BLOCK
    assert sz.max_concurrency == pytest.approx(513 / 512)  # as vLLM logs it: the null block counted
    # vLLM's API-server default on a >= 70 GiB non-A100 GPU: B 8192, S 1024 (vllm-flags.md section 3)
    assert (sz.flags.max_num_seqs, sz.flags.max_num_batched_tokens) == (1024, 8192)
    a100 = memory.size(LLAMA, Settings(max_model_len=8192), A100, int(0.9 * A100.cuda_total_bytes) - 2 * GIB)
    assert (a100.flags.max_num_seqs, a100.flags.max_num_batched_tokens) == (256, 2048)


def test_the_issue_example_fits_where_maxnumseqs_times_maxmodellen_did_not() -> None:
    """32k per request, 256 concurrent: sized by a KV request of ~40k tokens it fits an H100; booked as
    256 x 32k tokens it needs about 1 TiB (the issue's 'needs 1041.6 GiB')."""
    assert size(max_model_len=32768, max_num_seqs=256, kv_tokens=40_000).fits
    old = size(max_model_len=32768, max_num_seqs=256, kv_concurrency=256)
    assert not old.fits and old.footprint.kv_cache == (256 * 2048 + 1) * BLOCK  # 1024 GiB of KV


def test_grow_takes_the_room_offered_in_whole_blocks() -> None:
    sz = size(max_model_len=8192, kv_grow=True)
    assert sz.fits and sz.footprint.total <= BUDGET
    assert sz.footprint.kv_cache % BLOCK == 0
    assert BUDGET - sz.footprint.total < BLOCK + math.ceil(T / 10_000)  # less than a block + u's rounding left


def test_an_explicit_request_smaller_than_one_request_does_not_fit() -> None:
    sz = size(max_model_len=32768, kv_tokens=1000)
    assert not sz.fits and "cannot hold one request of 32768 tokens" in sz.reasons[0]


def test_tokens_and_memory_together_are_refused_naming_the_one_to_keep() -> None:
    with pytest.raises(memory.SpecError, match="keep tokens"):
        size(kv_tokens=1000, kv_bytes=GIB)
    from vllmfit.core.spec import api

    with pytest.raises(ValueError, match="keep tokens"):
        api.VLLMDeploymentSpec.model_validate({"model": "m", "kvCache": {"tokens": 1, "memory": "1Gi"}})


@pytest.mark.parametrize("text", ["20Gi", "1.5G", "512Mi", "2e9", "1E3", "0.5Ki", "100m", "1.5", ".5Gi", "3k", "12345"])
def test_quantities_parse_like_kubernetes(text: str) -> None:
    assert parse_bytes(text) == math.ceil(parse_quantity(text))  # Quantity.Value() rounds up


@pytest.mark.parametrize("text", ["20 Gi", "Gi", "-1Gi", "1GB", "1e", "1.2.3"])
def test_bad_quantities_are_one_line_errors(text: str) -> None:
    with pytest.raises(ValueError, match="kvCache.memory"):
        parse_bytes(text, "kvCache.memory")


# --- what the GPU can run ----------------------------------------------------------------------


def test_fp8_and_bf16_follow_the_compute_capability() -> None:
    assert (T4.compute_capability, A100.compute_capability, H100.compute_capability) == ((7, 5), (8, 0), (9, 0))
    with pytest.raises(memory.SpecError, match="cannot run fp8 weights"):
        memory.size(LLAMA, Settings(max_model_len=4096, quantization="fp8"), T4, 1 << 40)
    with pytest.raises(memory.SpecError, match="fp8 KV cache"):
        memory.size(LLAMA, Settings(max_model_len=4096, kv_cache_dtype="fp8"), T4, 1 << 40)
    with pytest.raises(memory.SpecError, match="use dtype: float16"):
        memory.size(LLAMA, Settings(max_model_len=4096, dtype="bfloat16"), T4, 1 << 40)
    auto = memory.size(LLAMA, Settings(max_model_len=4096), T4, 1 << 40)
    assert any("float16" in w for w in auto.warnings)
    ampere = memory.size(LLAMA, Settings(max_model_len=4096, quantization="fp8"), A100, 1 << 40)
    assert any("weight-only" in w for w in ampere.warnings)  # FP8 Marlin below compute capability 8.9
    assert not any("weight-only" in w for w in
                   memory.size(LLAMA, Settings(max_model_len=4096, quantization="fp8"), H100, 1 << 40).warnings)


def test_fixes_never_suggest_what_the_gpu_cannot_run() -> None:
    budget = int(0.9 * T4.cuda_total_bytes) - 2 * GIB
    texts = [f.text for f in memory.fixes(LLAMA, Settings(max_model_len=8192), T4, available=budget)]
    assert not any("fp8" in t for t in texts), texts
    texts_h = [f.text for f in memory.fixes(catalog.model("meta-llama/Llama-3.1-70B-Instruct"),
                                            Settings(max_model_len=8192), H100, available=BUDGET)]
    assert any("quantization: fp8" in t for t in texts_h)


def test_two_changes_together_when_neither_fits_alone() -> None:
    """70B at 8k on one H100: fp8 weights alone (~66 GiB) plus a one-request KV cache does not fit,
    nor does an fp8 KV cache alone; fp8 weights with TP 2 do (fewer GPUs than TP 4 alone)."""
    big = catalog.model("meta-llama/Llama-3.1-70B-Instruct")
    fixes = [f.text for f in memory.fixes(big, Settings(max_model_len=8192), H100, available=BUDGET)]
    assert "tensorParallelSize: 4" in fixes and "tensorParallelSize: 2, quantization: fp8" in fixes
    for text in fixes:
        fx = next(f for f in memory.fixes(big, Settings(max_model_len=8192), H100, available=BUDGET) if f.text == text)
        assert memory.size(big, fx.settings(Settings(max_model_len=8192)), H100, BUDGET).fits, text


# --- the budget policy -------------------------------------------------------------------------


CTX = int(0.55 * GIB)  # the CUDA context of one single-GPU vLLM process, outside its R
COUNTED = "ceil(0.9 x capacity) + 0.55 GiB CUDA context (counted)"


def test_vllms_own_default_alone_on_an_empty_gpu_is_admitted() -> None:
    """Issue 31: `--gpu-memory-utilization 0.9` (vLLM's default) for one server on an empty H100 uses
    R = ceil(0.9 T) plus its CUDA context outside R; the counted budget is exactly that."""
    est = memory.estimate(LLAMA, Settings(gpu_memory_utilization=0.9), H100)
    assert est.sizing.footprint.cuda_context == CTX == 590_558_003
    assert est.budget_bytes == math.ceil(0.9 * T) + CTX == 77_119_101_338
    assert est.sizing.footprint.total == est.budget_bytes  # what the lone vLLM really uses, to the byte
    assert est.sizing.fits and est.headroom_bytes == 0
    # a shared GPU keeps its margin: 0.1 T less one context (each colocated server books its own)
    assert est.capacity_bytes - est.budget_bytes == T - math.ceil(0.9 * T) - CTX == 7_912_613_478


def test_an_explicit_utilization_the_policy_refuses_gets_the_one_that_fits_and_the_policy_change() -> None:
    s = Settings(gpu_memory_utilization=0.92)  # above vLLM's own default, on an empty H100
    est = memory.estimate(LLAMA, s, H100)
    ctx = est.sizing.footprint.cuda_context
    counted = math.ceil(0.9 * T) + CTX
    assert not est.sizing.fits and ctx + math.ceil(T * 0.92) > counted
    assert f"budget policy (default) {COUNTED} holds back 7.4 GiB of 79.2 GiB" in est.sizing.reasons
    u = max(k / 10_000 for k in range(1, 10_000) if ctx + math.ceil(T * k / 10_000) <= counted)
    assert u == 0.9 and f"gpuMemoryUtilization: {u}" in est.suggestions
    want = 0.92  # the smallest 2-decimal utilization whose counted budget holds ctx + ceil(0.92 T)
    assert math.ceil(T * 0.91) + CTX < ctx + math.ceil(T * 0.92) <= math.ceil(T * want) + CTX
    fix = f"budget policy utilization {want:g} (now {COUNTED}: 7.4 GiB of this GPU held back)"
    assert fix in est.suggestions
    assert ctx + math.ceil(T * 0.92) <= BudgetPolicy(want, 0).budget(T)  # the policy change really admits it
    # the fixes come in the order a user tries them: the utilization first, the policy after
    assert est.suggestions.index(f"gpuMemoryUtilization: {u}") < est.suggestions.index(fix)


def test_adr_0002_by_name_refuses_the_same_and_offers_the_counted_policy() -> None:
    """ADR-0002's policy by name keeps its figures exactly: 0.9 x T - 2 GiB."""
    s = Settings(gpu_memory_utilization=0.9)
    est = memory.estimate(LLAMA, s, H100, policy=memory.policy_named("adr-0002"))
    ctx = est.sizing.footprint.cuda_context
    assert est.budget_bytes == BUDGET == 74_381_059_686
    assert "budget policy (default) 0.9 x capacity - 2.0 GiB (adr-0002) holds back 9.9 GiB of 79.2 GiB" \
        in est.sizing.reasons
    u = max(k / 10_000 for k in range(1, 10_000) if ctx + math.ceil(T * k / 10_000) <= BUDGET)
    assert f"gpuMemoryUtilization: {u}" in est.suggestions
    # counted admits vLLM's default (its budget counts the lone server's context), so it is offered
    assert ("budget policy counted (ceil(0.9 x capacity) + 0.55 GiB CUDA context; now 0.9 x capacity - 2.0 GiB "
            "(adr-0002): 9.9 GiB of this GPU held back)") in est.suggestions
    assert ctx + math.ceil(T * 0.9) <= memory.DEFAULT_POLICY.budget(T)


def test_a_spec_refused_only_by_adr_0002_gets_the_counted_policy_as_a_checked_fix() -> None:
    """Llama-3.1-8B bf16 at 8k on an L4: 19.2 GiB > ADR-0002's 17.8 GiB budget, < counted's 20.3 GiB."""
    l4 = catalog.gpu("NVIDIA-L4")
    s = Settings(max_model_len=8192)
    adr = memory.estimate(LLAMA, s, l4, policy=memory.ADR_POLICY)
    assert not adr.sizing.fits
    assert adr.suggestions[0] == ("budget policy counted (ceil(0.9 x capacity) + 0.55 GiB CUDA context; now "
                                  "0.9 x capacity - 2.0 GiB (adr-0002): 4.2 GiB of this GPU held back)")
    counted = math.ceil(0.9 * 23616028672) + CTX
    assert adr.sizing.footprint.total <= memory.DEFAULT_POLICY.budget(l4.cuda_total_bytes) == counted
    assert memory.estimate(LLAMA, s, l4).sizing.fits  # and the default admits it


def test_a_policy_sets_the_budget_and_bad_ones_are_refused() -> None:
    assert BudgetPolicy(0.95, GIB).budget(T) == math.ceil(0.95 * T) + CTX - GIB
    assert BudgetPolicy().budget(T) == math.ceil(0.9 * T) + CTX == 77_119_101_338  # counted, the default
    assert BudgetPolicy(1.0, 0).budget(T) == T and BudgetPolicy(0.0, 0).budget(T) == 0  # never more than the GPU
    assert memory.ADR_POLICY.budget(T) == memory.policy_named("adr-0002").budget(T) == BUDGET
    assert (BudgetPolicy().name, memory.ADR_POLICY.name, BudgetPolicy(0.95, GIB).name) == ("counted", "adr-0002", "custom")
    assert BudgetPolicy(0.9, 0, context_bytes=0).name == "custom"
    assert memory.default_policy("adr") == memory.ADR_POLICY and memory.default_policy("vllm") == BudgetPolicy()
    assert BudgetPolicy(1.2).error() and BudgetPolicy(-0.1).error() and BudgetPolicy(float("nan")).error()
    assert "larger than the GPU" in (BudgetPolicy(0.9, 100 * GIB).error(T) or "")
    assert BudgetPolicy(0.0, 0).error(T) is None and BudgetPolicy(1.0, 0).error(T) is None


@pytest.mark.parametrize("argv,says", [
    (["--budget-utilization", "1.5"], "--budget-utilization 1.5 (CLI) is outside [0, 1]"),
    (["--budget-utilization", "-0.1"], "outside [0, 1]"),
    (["--budget-reserve", "100Gi"], "larger than the GPU"),
    (["--budget-reserve", "lots"], "not a Kubernetes quantity"),
    (["--kv-cache-tokens", "1000", "--kv-cache-memory", "1Gi"], "keep --kv-cache-tokens"),
    (["--kv-cache-tokens", "40000000"], "the largest that fits is --kv-cache-tokens"),  # CLI words (issue 24)
])
def test_bad_policy_and_kv_requests_exit_2_with_one_line(capsys, argv: list[str], says: str) -> None:
    code = cli.main(["estimate", "--model", LLAMA.name, *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err and "Traceback" not in err


def test_the_cli_policy_moves_the_budget(capsys) -> None:
    import json

    assert cli.main(["estimate", "--model", LLAMA.name, "--max-model-len", "8192", "--budget-utilization", "0.95",
                     "--budget-reserve", "1Gi", "-o", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["per_gpu"]["budget_bytes"] == math.ceil(0.95 * T) + CTX - GIB
    assert d["budget_policy"] == {"name": "custom", "utilization": 0.95, "reserve_bytes": GIB, "source": "CLI",
                                  "context_bytes": CTX, "held_back_bytes": T - (math.ceil(0.95 * T) + CTX - GIB)}


@pytest.mark.parametrize("argv,says", [
    (["--budget-utilization", "1.2"], "--budget-utilization 1.2 (cluster) is outside [0, 1]"),
    (["--budget-reserve", "two gigs"], "--budget-reserve 'two gigs' is not a Kubernetes quantity"),
])
def test_the_operator_refuses_a_bad_cluster_policy_before_starting(capsys, argv: list[str], says: str) -> None:
    code = cli.main(["operator", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err


def test_cli_errors_speak_flags_and_a_request_below_one_request_is_not_called_too_large(capsys) -> None:
    """Issue 24: the CLI names its flags (the webhook keeps the spec's fields); a KV request smaller than
    one request of maxModelLen is refused by the sizing (exit 1) with checked fixes, not as 'more than
    any GPU can hold'."""
    import json

    assert cli.main(["estimate", "--model", LLAMA.name, "--max-num-seqs", "4096", "--max-num-batched-tokens", "2048"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens 2048 is less than --max-num-seqs 4096" in err and "max_num" not in err
    assert cli.main(["estimate", "--model", LLAMA.name, "--max-model-len", "8192", "--kv-cache-tokens", "4000",
                     "-o", "json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["reasons"][0].startswith("KV cache 0.5 GiB cannot hold one request of 8192 tokens")
    # 4000 tokens = 250 blocks: the longest request they hold is 4000 tokens; 8192 tokens hold one of 8192
    assert d["suggestions"] == ["maxModelLen: 4000", "kvCache: {tokens: 8192}"]
    for argv in (["--max-model-len", "4000", "--kv-cache-tokens", "4000"], ["--max-model-len", "8192", "--kv-cache-tokens", "8192"]):
        assert cli.main(["estimate", "--model", LLAMA.name, *argv, "-o", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["fits"]


def test_fewer_sequences_come_first_and_the_cli_prints_them_as_flags(capsys, monkeypatch) -> None:
    """Issue 24: for kvCache.concurrency the first fix is the most requests of the same length that fit
    (checked: that many fit, one more does not); the CLI prints it as --kv-concurrency."""
    import json

    monkeypatch.setenv("COLUMNS", "200")
    argv = ["estimate", "--model", LLAMA.name, "--gpu", "NVIDIA-L4", "--max-model-len", "16384", "--quantization", "fp8",
            "--kv-concurrency", "8"]
    assert cli.main([*argv, "-o", "json"]) == 1
    d = json.loads(capsys.readouterr().out)
    first = d["suggestions"][0]
    assert first.startswith("kvCache.concurrency: ")
    n = int(first.split(": ")[1])
    assert 1 <= n < 8
    assert cli.main(argv) == 1
    assert f"\n  --kv-concurrency {n}\n" in capsys.readouterr().out
    for c, code in ((n, 0), (n + 1, 1)):  # n requests of 16384 tokens fit, n + 1 do not
        assert cli.main([*argv[:-1], str(c), "-o", "json"]) == code
        capsys.readouterr()


# --- issue 33: the cluster's default KV grant is one more choice with one-line errors -------------

@pytest.mark.parametrize("command,argv,says", [
    ("estimate", ["--model", LLAMA.name, "--default-kv-requests", "0"], "--default-kv-requests 0 must be in [1, 4096]"),
    ("plan", ["-f", "examples/sharing/six-small.yaml", "--default-kv-requests", "5000"], "--default-kv-requests 5000"),
    ("operator", ["--default-kv-requests", "0"], "--default-kv-requests 0 must be in [1, 4096]"),
    ("operator", ["--default-kv-grant", "all"], "invalid choice: 'all'"),
])
def test_a_bad_default_kv_grant_exits_2_with_one_line(capsys, monkeypatch, command: str, argv: list[str],
                                                       says: str) -> None:
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with contextlib.suppress(SystemExit):  # argparse's own choices: exit 2 by SystemExit
        code = cli.main([command, *argv])
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "Traceback" not in err


def test_the_operators_default_kv_grant_reaches_its_ledger(monkeypatch) -> None:
    """--default-kv-grant room: the flag (or $VLLMFIT_DEFAULT_KV_GRANT) is parsed before start-up and
    every ledger the store builds (start-up, rebuild, resync) carries it."""
    import argparse

    from vllmfit.core import choices
    from vllmfit.operator import main as opmain
    from vllmfit.operator.booking.state import Options, Store

    monkeypatch.setenv("VLLMFIT_DEFAULT_KV_GRANT", "room")
    monkeypatch.setenv("VLLMFIT_DEFAULT_KV_REQUESTS", "2")
    p = argparse.ArgumentParser()
    opmain.add_parser(p.add_subparsers())
    grant = choices.kv_grant_from_args(p.parse_args(["operator"]))
    assert grant == memory.KvGrant("room", 2)
    store = Store(Options(kv_grant=grant))
    assert store.books.ledger.kv_grant == grant
    assert store.rebuild([], []) == [] and store.books.ledger.kv_grant == grant
