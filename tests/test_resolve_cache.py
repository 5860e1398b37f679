"""`sizing.resolve` is cached (issue 32: a refusal's fixes size the same settings for several rooms).
The cache must never answer for other inputs: against the uncached `_resolve` and `size` computed
with it, over random models, GPUs and settings, each asked with fresh (equal, not identical) values."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.core import memory
from vllmfit.core.memory import Settings, SpecError, sizing
from vllmfit.sources import catalog

MODELS = sorted(catalog.models())
GPUS = sorted(catalog.gpus())

_settings = st.builds(
    Settings,
    tp=st.sampled_from([1, 2, 4, 8, 3]),
    pp=st.sampled_from([1, 2]),
    dtype=st.sampled_from(["auto", "bfloat16", "float16"]),
    quantization=st.sampled_from([None, "fp8", "awq"]),
    kv_cache_dtype=st.sampled_from(["auto", "fp8"]),
    max_model_len=st.sampled_from([None, 1024, 4096, 32768, 131072]),
    max_num_seqs=st.sampled_from([None, 1, 64, 512]),
    max_num_batched_tokens=st.sampled_from([None, 2048, 8192]),
    gpu_memory_utilization=st.sampled_from([None, 0.5, 0.9]),
    enforce_eager=st.booleans(),
    vllm_version=st.sampled_from(["0.11", "0.19.1", "v0.21.0", "vllm/vllm-openai:v0.33.0", "latest", "0.9"]),
    policy=st.sampled_from(["vllm", "adr"]),
    kv_tokens=st.sampled_from([None, 4096, 100_000]),
    kv_grow=st.booleans(),
    lora_max_loras=st.sampled_from([None, 2]),
    cpu_offload_bytes=st.sampled_from([0, 1 << 30]),
    strict=st.booleans(),
)


def _uncached(model, s, gpu):
    try:
        return sizing._resolve(model, s, gpu)
    except SpecError as e:
        return f"SpecError: {e}"


def _cached(model, s, gpu):
    try:
        return sizing.resolve(model, s, gpu)
    except SpecError as e:
        return f"SpecError: {e}"


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(GPUS), _settings, _settings)
def test_resolve_cache_answers_as_the_uncached_computation(name, product, s, t):
    model, gpu = catalog.model(name), catalog.gpu(product)
    for x in (s, t, s, t):  # two inputs through the same cache, each asked twice, with fresh equal copies
        fresh = copy.deepcopy(x)
        assert _cached(copy.deepcopy(model), fresh, copy.deepcopy(gpu)) == _uncached(model, fresh, gpu)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(GPUS), _settings,
       st.sampled_from([memory.UNLIMITED, 20 << 30, 70 << 30, 1 << 30]))
def test_size_with_the_cache_is_size_without_it(name, product, s, available):
    model, gpu = catalog.model(name), catalog.gpu(product)

    def size() -> object:
        try:
            return memory.size(model, s, gpu, available)
        except SpecError as e:
            return f"SpecError: {e}"

    cached = [size(), size()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "resolve", sizing._resolve)
        assert cached == [size(), size()]


def test_settings_that_differ_in_one_field_are_not_one_entry():
    """Every compared field is part of the key: the learned records included (sizes booked above)."""
    model, gpu = catalog.model("meta-llama/Llama-3.1-8B-Instruct"), catalog.gpu("NVIDIA-L4")
    s = Settings(max_model_len=8192)
    assert sizing.resolve(model, s, gpu).settings == s
    for other in (replace(s, max_model_len=4096), replace(s, learned=(("k", 1, 2, "x"),)),
                  replace(s, enforce_eager=True)):
        assert sizing.resolve(model, other, gpu) == sizing._resolve(model, other, gpu)
        assert sizing.resolve(model, other, gpu).settings == other
