"""Bounded work and names (issue 14, items 3, 6, 10): physical limits on every count, model
names the Hugging Face Hub would refuse, Kubernetes names where they become object names."""

from __future__ import annotations

import json
import math
import os
import signal
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from huggingface_hub.utils import HFValidationError, validate_repo_id
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllmfit.core import limits, memory
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.model.facts import ModelConfigError, check_tp
from vllmfit.core.spec import api, names
from vllmfit.sources import catalog

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "max_position_embeddings": 8192, "intermediate_size": 14336}


@contextmanager
def bounded(seconds: int = 20, megabytes: int = 200) -> Iterator[None]:
    """A hang and memory guard, not a speed check: the unbounded inputs of the issue ran for
    minutes or allocated gigabytes; a bounded one is 1,000 times inside these limits."""
    def _alarm(*_: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak < megabytes << 20, f"peak {peak >> 20} MiB"
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", 10**9),  # allocated a 1e9-entry layer_types tuple (gigabytes)
    ("num_attention_heads", 10**12),  # check_tp looped over 1e12 divisor candidates with TP 3
    ("hidden_size", 10**12),
    ("vocab_size", 10**13),
    ("intermediate_size", 10**12),
    ("num_local_experts", 10**9),
    ("max_position_embeddings", 10**15),
])
def test_absurd_config_values_are_one_line_errors(field: str, value: int) -> None:
    cfg = {**LLAMA, field: value}
    if field == "num_attention_heads":
        cfg["num_key_value_heads"] = value
    with bounded(), pytest.raises(ModelConfigError) as e:
        parse_hf_config(cfg, name="x")
    assert len(str(e.value).splitlines()) == 1
    assert "more than any real model" in str(e.value)


def test_rope_factor_inf_and_nan_are_refused() -> None:
    for factor in (math.inf, math.nan, -2.0, "x"):
        cfg = {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": factor}}
        with pytest.raises(ModelConfigError):
            parse_hf_config(cfg, name="x")


def test_check_tp_with_many_heads_lists_divisors_without_looping_over_heads() -> None:
    a = parse_hf_config({**LLAMA, "num_attention_heads": 4096, "num_key_value_heads": 4096, "hidden_size": 8192},
                        name="x")
    with bounded(seconds=5):
        msg = check_tp(a, 3)
    # divisors of 4096 up to the TP limit, in order (computed by hand: powers of two)
    assert msg is not None and "use one of 1, 2, 4, 8, 16, 32, 64" in msg


def test_spec_bounds_are_the_named_limits() -> None:
    base = {"model": "org/m"}
    for field, limit in (("tensorParallelSize", limits.MAX_TP), ("pipelineParallelSize", limits.MAX_PP),
                         ("replicas", limits.MAX_REPLICAS), ("maxModelLen", limits.MAX_CONTEXT),
                         ("maxNumSeqs", limits.MAX_NUM_SEQS), ("maxNumBatchedTokens", limits.MAX_BATCHED_TOKENS),
                         ("modelParams", limits.MAX_PARAMS)):
        extra = {"maxNumSeqs": 1} if field == "maxNumBatchedTokens" else {}
        api.VLLMDeploymentSpec.model_validate({**base, **extra, field: limit})
        with pytest.raises(ValueError):
            api.VLLMDeploymentSpec.model_validate({**base, **extra, field: limit + 1})


def test_batched_tokens_below_max_num_seqs_is_refused_by_the_spec() -> None:
    with pytest.raises(ValueError, match="maxNumBatchedTokens 100 is less than maxNumSeqs 256"):
        api.VLLMDeploymentSpec.model_validate({"model": "org/m", "maxNumSeqs": 256, "maxNumBatchedTokens": 100})
    # maxNumSeqs unset: vLLM's default is min(S_default, B) (vllm-flags.md section 3), never above B
    api.VLLMDeploymentSpec.model_validate({"model": "org/m", "maxNumBatchedTokens": 1})


# --- Fuzz: inline configs ---------------------------------------------------------------------

EXAMPLES = int(os.environ.get("VLLMFIT_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
count = st.one_of(st.integers(min_value=-3, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                  st.sampled_from([0, 1, 3, 7, 64, 4096, 10**9, 10**12, "12", "x", None, True]))
FIELDS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "max_position_embeddings", "intermediate_size", "head_dim", "num_local_experts", "num_experts_per_tok",
          "moe_intermediate_size", "first_k_dense_replace", "n_shared_experts", "sliding_window",
          "kv_lora_rank", "qk_rope_head_dim", "q_lora_rank", "partial_rotary_factor", "model_max_length"]


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), count, max_size=6),
       st.sampled_from(["llama", "deepseek_v3", "gemma3", "mixtral"]), st.sampled_from([1, 2, 3, 8]))
def test_fuzz_inline_configs_finish_in_bounded_time_and_memory(changes: dict[str, Any], model_type: str,
                                                               tp: int) -> None:
    cfg = {**LLAMA, "model_type": model_type, **changes}
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    with bounded():
        try:
            arch = parse_hf_config(cfg, name="fuzz")
        except ModelConfigError as e:
            assert len(str(e).splitlines()) == 1
            return
        s = memory.Settings(tp=tp, max_model_len=min(arch.max_model_len, 4096))
        errors = memory.validate(arch, s)
        if not errors:
            est = memory.estimate(arch, s, gpu)
            assert isinstance(est.sizing.footprint.total, int)
            json.dumps(est.sizing.reasons)


# --- Names ----------------------------------------------------------------------------------------

HUB_NAMES = ["meta-llama/Llama-3.1-8B", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "a" * 96, "org/" + "b" * 96,
             "../etc/passwd", "/models/llama", "https://huggingface.co/meta-llama/Llama-3.1-8B", "a" * 97,
             "org/" + "b" * 97, "café/model", "模型", "org/name/extra", "org--name", "org/na..me", "model.git",
             "-lead", "trail-", ".dot", "org/", "/name", "a b", "org/model\n", "x" * 300]


@pytest.mark.parametrize("name", HUB_NAMES)
def test_model_names_are_refused_exactly_when_the_hub_client_refuses_them(name: str) -> None:
    try:
        validate_repo_id(name)
        hub_ok = True
    except HFValidationError:
        hub_ok = False
    assert (names.model_name_problem(name) is None) == hub_ok


@given(st.text(max_size=120))
@settings(max_examples=300, deadline=None, database=None)
def test_model_names_agree_with_the_hub_client_on_any_text(name: str) -> None:
    try:
        validate_repo_id(name)
        hub_ok = True
    except (HFValidationError, ValueError):
        hub_ok = False
    assert (names.model_name_problem(name) is None) == hub_ok


def test_every_catalog_name_and_alias_is_a_valid_repo_id() -> None:
    for m in catalog.models().values():
        for n in (m.name, *m.aliases):
            assert names.model_name_problem(n) is None, n


@pytest.mark.parametrize("model", ["../x", "https://example.com/m", "a" * 97, "ünïcode/m"])
def test_the_spec_rejects_a_bad_model_name_at_once_with_the_reason(model: str) -> None:
    with pytest.raises(ValueError, match="is not a Hugging Face repo id"):
        api.VLLMDeploymentSpec.model_validate({"model": model})


@pytest.mark.parametrize("field,value", [
    (("hfTokenSecretRef", "name"), "Bad_Name"),
    (("modelConfigRef", "name"), "x" * 254),
    (("modelConfigRef", "key"), "a/b"),
    (("placement", "nodeName"), "Node 1"),
])
def test_kubernetes_names_are_checked_where_they_name_objects(field: tuple[str, str], value: str) -> None:
    outer, inner = field
    with pytest.raises(ValueError, match="must be a"):
        api.VLLMDeploymentSpec.model_validate({"model": "org/m", outer: {"name": "ok", inner: value}
                                               if outer != "placement" else {inner: value}})
