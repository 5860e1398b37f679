"""spec.extraArgs checked with vLLM's parsing rules (issue 14, item 7; /work/stage/vllm-flags.md §1):
abbreviations (allow_abbrev), --flag=value, underscores, dotted JSON keys, single-dash aliases
with glued values, -O levels, --no-X forms; memory-changing flags are refused with a message."""

from __future__ import annotations

import argparse

import pytest

from vllmfit.core.spec import api, extraargs


@pytest.mark.parametrize("args,option", [
    (["--gpu-memory-util=0.99"], "--gpu-memory-utilization"),  # the bypass
    (["--kv-cache-memory=80G"], "--kv-cache-memory-bytes"),  # the spelling vLLM's own log suggests
    (["--gpu", "0.5"], "--gpu-memory-utilization"),
    (["--max-model", "4096"], "--max-model-len"),
    (["--tensor-parallel", "2"], "--tensor-parallel-size"),
    (["--max_model_len=4096"], "--max-model-len"),
    (["--max_model-len", "4096"], "--max-model-len"),
    (["-tp=2"], "--tensor-parallel-size"),
    (["-t", "2"], "--tensor-parallel-size"),  # a prefix of -tp
    (["-qfp8"], "--quantization"),  # -q with its value glued on
    (["-O3"], "--optimization-level"),
    (["-O", "3"], "--optimization-level"),
    (["-cc.mode=3"], "--compilation-config"),
    (["--hf-overrides.num_hidden_layers", "2"], "--hf-overrides"),
    (["--hf_overrides.rope_scaling.factor", "4"], "--hf-overrides"),
    (["--speculative-config", '{"model": "draft", "num_speculative_tokens": 5}'], "--speculative-config"),
    (["-sc", "{}"], "--speculative-config"),
    (["--enable-lora", "--max-loras", "4"], "--enable-lora"),
    (["--max-lora-rank=64"], "--max-lora-rank"),
    (["--cpu-offload-gb", "10"], "--cpu-offload-gb"),
    (["--kv-offloading-size", "8"], "--kv-offloading-size"),
    (["--no-enforce-eager"], "--enforce-eager"),
    (["--no-enable-chunked-prefill"], "--enable-chunked-prefill"),
    (["--port=9000"], "--port"),
    (["--config", "serve.yaml"], "--config"),
    (["--conf", "serve.yaml"], "--config"),  # ambiguous in vLLM; a refused option among the candidates
])
def test_refused_in_every_spelling(args: list[str], option: str) -> None:
    assert option in {p.option for p in extraargs.problems(args)}


@pytest.mark.parametrize("args", [
    ["--served-model-name", "llama", "--max-logprobs=5", "--enable-prefix-caching"],
    ["--seed", "-1"],  # a negative number is a value, not an option
    ["--swap-space", "4"],  # host RAM only (vllm-flags.md §2: no GPU memory); modelled as 0 GPU bytes
    ["--config-format", "hf", "--tokenizer", "x", "--model-impl", "vllm"],  # exact options, not prefixes
    ["--chat-template", "{% for m in messages %}{{ m }}{% endfor %}"],
])
def test_harmless_args_pass(args: list[str]) -> None:
    assert extraargs.problems(args) == []


def test_prefix_resolution_agrees_with_argparse_allow_abbrev() -> None:
    # The same table in a real argparse parser with allow_abbrev (vLLM's FlexibleArgumentParser
    # is an ArgumentParser with the default allow_abbrev=True): whatever argparse resolves a long
    # prefix to, extraargs refuses it.
    p = argparse.ArgumentParser(allow_abbrev=True, exit_on_error=False)
    for opt in extraargs.REFUSED:
        p.add_argument(opt, dest=opt.strip("-").replace("-", "_"))
    allowed = sorted(extraargs.KNOWN - set(extraargs.REFUSED))  # every other option of vLLM 0.11-0.33
    for opt in allowed:
        p.add_argument(opt)
    for opt in extraargs.REFUSED:
        for cut in range(3, len(opt) + 1):
            prefix = opt[:cut]
            try:
                _ns, extra = p.parse_known_args([prefix, "1"])
            except (argparse.ArgumentError, SystemExit):
                continue  # ambiguous: vLLM errors out; refused here as well (checked below)
            if extra or any(getattr(_ns, o.strip("-").replace("-", "_")) for o in allowed):
                continue  # not an option, or argparse took the exact allowed option
            assert extraargs.problems([prefix, "1"]), prefix
    assert extraargs.problems(["--max-num", "1"])  # ambiguous in vLLM (--max-num-seqs, --max-num-batched-...)


# --- issue 21 item 4: what is loaded must be what was sized; no code imported by name --------------
# Written first: every case below passed on the old code.

@pytest.mark.parametrize("args,option", [
    (["--revision", "refs/pr/7"], "--revision"),
    (["--rev=abc123"], "--revision"),
    (["--code-revision", "main"], "--code-revision"),
    (["--hf-config-path", "/models/other"], "--hf-config-path"),
    (["--hf_config_path=/x"], "--hf-config-path"),
    (["--model-loader-extra-config", "{}"], "--model-loader-extra-config"),
    (["--load-format", "dummy"], "--load-format"),
    (["--load-format=tensorizer"], "--load-format"),
    (["--load-f", "gguf"], "--load-format"),
    (["--load_format=bitsandbytes"], "--load-format"),
    (["--load-format", "sharded_state"], "--load-format"),
    (["--config-format", "mistral"], "--config-format"),
    (["--worker-cls", "evil.Worker"], "--worker-cls"),
    (["--worker-extension-cls=evil.Ext"], "--worker-extension-cls"),
    (["--logits-processors", "evil.Proc"], "--logits-processors"),
    (["--logits-processor-pattern", ".*"], "--logits-processor-pattern"),
    (["--scheduler-cls", "evil.Sched"], "--scheduler-cls"),
    (["--middleware", "evil.mw"], "--middleware"),
    (["--tool-parser-plugin", "/tmp/p.py"], "--tool-parser-plugin"),
    (["--reasoning-parser-plugin", "/tmp/p.py"], "--reasoning-parser-plugin"),
    (["--io-processor-plugin", "evil"], "--io-processor-plugin"),
    (["--additional-config", "{}"], "--additional-config"),
    (["--distributed-executor-backend", "evil.Executor"], "--distributed-executor-backend"),
    (["--distributed-executor-backend=ray"], "--distributed-executor-backend"),
])
def test_flags_that_change_what_is_loaded_or_import_code_are_refused(args: list[str], option: str) -> None:
    problems = extraargs.problems(args)
    assert option in {p.option for p in problems}, problems
    assert all("\n" not in p.message for p in problems)


@pytest.mark.parametrize("args", [
    ["--load-format", "safetensors"], ["--load-format=auto"], ["--load-format", "runai_streamer"],
    ["--config-format", "hf"], ["--distributed-executor-backend", "mp"], ["--tokenizer-revision", "v2"],
    ["--reasoning-parser", "deepseek_r1"], ["--tool-call-parser", "hermes"],
])
def test_loading_as_sized_passes(args: list[str]) -> None:
    assert extraargs.problems(args) == []


def test_the_spec_denies_extra_args_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"extraArgs --gpu-memory-util \(= --gpu-memory-utilization\) is set by "
                                         r"vllmfit; use spec.gpuMemoryUtilization instead"):
        api.VLLMDeploymentSpec.model_validate({"model": "org/m", "extraArgs": ["--gpu-memory-util=0.99"]})
    with pytest.raises(ValueError, match="speculative-config changes GPU memory"):
        api.VLLMDeploymentSpec.model_validate({"model": "org/m", "extraArgs": ["--speculative-config", "{}"]})
