"""`vllmfit estimate`: the JSON contract and bad input (one line, exit code 2, no traceback)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from vllmfit import main as cli

LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, _ = run(capsys, "estimate", "--model", LLAMA8, "--max-model-len", "8192", "--max-num-seqs", "8", "--kv-concurrency", "8",
                       "--output", "json")
    assert code == 0
    d = json.loads(out)
    for key in ("weights_bytes", "kv_cache_bytes", "activation_bytes", "overhead_bytes", "reserve_bytes",
                "total_bytes", "budget_bytes", "headroom_bytes"):
        assert isinstance(d["per_gpu"][key], int)
    assert d["kv_bytes_per_token"] == 131_072  # 2 x 32 layers x 8 heads x 128 x 2 B
    assert d["kv_cache_tokens"] >= 8 * 8192 and d["max_concurrency"] >= 8
    assert d["flags"]["max_model_len"] == 8192 and d["flags"]["max_num_seqs"] == 8
    assert 0 < d["flags"]["gpu_memory_utilization"] <= 1
    assert d["fits"] is True and d["reasons"] == []
    for key in ("requested_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes",
                "kv_cache_bytes", "kv_cache_tokens", "num_gpu_blocks", "max_concurrency"):
        assert key in d["vllm"]
    assert d["per_gpu"]["headroom_bytes"] == d["per_gpu"]["budget_bytes"] - d["per_gpu"]["total_bytes"]


def test_the_issue_example_fits_on_two_h100(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--quantization", "fp8",
                       "--tp", "2", "--gpu", "NVIDIA-H100-80GB-HBM3", "--max-model-len", "32768", "--output", "json")
    d = json.loads(out)
    assert code == 0 and d["fits"]
    # fp8 70B over 2 GPUs: about 70.6e9 x 1 B / 2 = 33 GiB of weights per GPU (calibration log: 33.88 GiB)
    assert 32 * 2**30 < d["per_gpu"]["weights_bytes"] < 35 * 2**30


def test_misfit_exit_code_and_fixes(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--max-model-len", "32768",
                       "--output", "json")
    d = json.loads(out)
    assert code == 1 and not d["fits"] and d["reasons"] and d["suggestions"]


def test_table_output(capsys):
    code, out, _ = run(capsys, "estimate", "--model", LLAMA8, "--max-model-len", "8192")
    assert code == 0 and "--max-model-len" in out.replace("max_model_len", "--max-model-len")


@pytest.mark.parametrize("argv, needle", [
    (["--model", "lama-3.1-8b"], "closest"),
    (["--model", LLAMA8, "--gpu", "H1000"], "unknown gpu"),
    (["--model", LLAMA8, "--tp", "3"], "does not divide"),
    (["--model", LLAMA8, "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--model", LLAMA8, "--max-model-len", "1000000"], "exceeds"),
    (["--model", LLAMA8, "--quantization", "awq"], "cannot load"),
    (["--model", LLAMA8, "--max-num-seqs", "-4"], "positive"),
    (["--model", LLAMA8, "--max-model-len", "lots"], "not a number"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, _out, err = run(capsys, "estimate", *argv)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_config_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    code, _, err = run(capsys, "estimate", "--model-config", str(bad))
    assert code == 2 and "not valid JSON" in err
    bad.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": -1}))
    code, _, err = run(capsys, "estimate", "--model-config", str(bad))
    assert code == 2 and "num_hidden_layers" in err


def test_model_config_dir_with_safetensors_index(tmp_path, capsys):
    # a tiny Llama-shaped model; the index gives the exact parameter bytes
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
           "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2_000_000}}))
    code, out, _ = run(capsys, "estimate", "--model-config", str(tmp_path), "--gpu", "L4", "--output", "json")
    d = json.loads(out)
    assert code == 0
    # 1,000,000 params x 2 B, embeddings+lm_head 2 x 1000 x 256 padded to 1024 rows (+2 x 24 x 256 x 2 B),
    # plus the rope cache 2048 positions x head dim 64 x 2 B
    assert abs(d["per_gpu"]["weights_bytes"] - 2_000_000 - 2048 * 64 * 2) <= 2 * 24 * 256 * 2


def test_no_traceback_from_the_real_entry_point():
    p = subprocess.run([sys.executable, "-m", "vllmfit", "estimate", "--model", "nope-model"],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_fixes_in_the_table_are_cli_flags_that_the_parser_accepts(capsys):
    """The terminal speaks in flags (`--tp 16`), the JSON in spec fields (`tensorParallelSize: 16`):
    each printed fix, passed back as flags, fits."""
    argv = ["estimate", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "NVIDIA-L40S", "--max-model-len", "32768"]
    code, out, _ = run(capsys, *argv)
    assert code == 1
    fixes = out.split("fits with (each checked):\n", 1)[1].splitlines()
    fixes = [f.strip() for f in fixes if f.startswith("  --")]
    assert fixes == ["--tp 8", "--tp 4 --quantization fp8"]  # TP first, then fewer GPUs with fp8 weights
    for fix in fixes:
        code, out, _ = run(capsys, *argv, *fix.split(), "--output", "json")
        assert code == 0 and json.loads(out)["fits"], fix
    code, out, _ = run(capsys, *argv, "--output", "json")
    assert "tensorParallelSize: 4, quantization: fp8" in json.loads(out)["suggestions"]


def test_no_fix_asks_for_more_gpus_than_one_server_has(capsys):
    """Llama-3.1-70B at 128k on an L4 would need TP 16 with fp8 weights: beyond the 8 GPUs of a server,
    so it is not offered (issue 24: never a TP beyond the node's GPUs)."""
    code, out, _ = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "NVIDIA-L4",
                       "--max-model-len", "131072", "--output", "json")
    assert code == 1
    assert not any("tensorParallelSize: 16" in f for f in json.loads(out)["suggestions"])


def test_every_spec_field_a_fix_names_maps_to_an_estimate_flag():
    from vllmfit.cli.render import layout

    parser = cli.build_parser("estimate")
    estimate = parser._subparsers._group_actions[0].choices["estimate"]
    flags = {opt for a in estimate._actions for opt in a.option_strings}
    assert set(layout.SPEC_FLAGS.values()) <= flags


@pytest.mark.parametrize("command", [["models"], ["models", "-o", "wide"], ["gpus"], ["gpus", "-o", "wide"]])
@pytest.mark.parametrize("columns", ["60", "80", "120"])
def test_listings_never_cut_a_name(capsys, monkeypatch, command, columns):
    from vllmfit.sources import catalog

    monkeypatch.setenv("COLUMNS", columns)
    code, out, _ = run(capsys, *command)
    assert code == 0 and "…" not in out
    names = catalog.models() if command[0] == "models" else catalog.gpus()
    lines = out.splitlines()
    header = lines[0].split()
    assert header[0] in ("NAME", "PRODUCT") and (("ALIASES" in header) == ("wide" in command))
    for name in names:  # every name whole, at the start of its own row
        assert any(line.split(" ")[0] == name for line in lines), name


# --- issue 24: the common case on one 24 GB GPU ----------------------------------------------------

COMMON_GPUS = {"NVIDIA-L4": 23616028672, "NVIDIA-A10G": 23609737216, "NVIDIA-GeForce-RTX-4090": 25220349952}
COMMON_MODELS = {"meta-llama/Llama-3.1-8B-Instruct": 131072, "Qwen/Qwen2.5-7B-Instruct": 57344}  # KV B/token, bf16


@pytest.mark.parametrize("rule", ["requests", "room"])
@pytest.mark.parametrize("gpu", sorted(COMMON_GPUS))
@pytest.mark.parametrize("model", sorted(COMMON_MODELS))
def test_an_8b_in_bf16_at_8k_is_admitted_on_a_24gb_gpu_with_the_kv_grant_shown(capsys, monkeypatch, gpu, model, rule):
    """Plain vLLM serves these at its default --gpu-memory-utilization 0.9; so does vllmfit's default
    (the counted policy: budget = ceil(0.9 x T) + one CUDA context, 0.55 GiB). With no KV request the
    KV request is 2 requests of 8192 tokens (2 x 512 blocks + the null block); the limit is vLLM's
    default maxNumSeqs 256 x 8192. `requests` grants a fair share, at most 1/8 of the budget for the
    whole footprint: less than the weights, so exactly the request; `room` grows into the room left
    on the empty GPU in whole blocks. Never below the request, and the rule is shown."""
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "estimate", "--model", model, "--gpu", gpu, "--max-model-len", "8192", "-o", "json",
                       "--default-kv-grant", rule)
    d = json.loads(out)
    T, per_token = COMMON_GPUS[gpu], COMMON_MODELS[model]
    budget = math.ceil(0.9 * T) + int(0.55 * (1 << 30))
    block = 16 * per_token
    assert code == 0 and d["fits"]
    assert d["per_gpu"]["capacity_bytes"] == T and d["per_gpu"]["budget_bytes"] == budget
    assert d["per_gpu"]["reserve_bytes"] == 0 and d["budget_policy"]["held_back_bytes"] == T - budget
    kv, total = d["per_gpu"]["kv_cache_bytes"], d["per_gpu"]["total_bytes"]
    assert kv % block == 0 and total <= budget
    granted = d["kv_cache"]["granted_tokens"]
    assert granted == kv // per_token - 16 >= 2 * 8192  # vLLM 0.33 holds the null block back
    two = (2 * 8192 // 16 + 1) * block  # the request: 2 requests of 512 blocks + the null block
    assert d["kv_cache"]["request_tokens"] == 16_384 and d["kv_cache"]["limit_tokens"] == 256 * 8192
    if rule == "requests":
        assert kv == two and granted == 16_384
        assert d["kv_cache"]["granted_by"] == "default request: 2 x maxModelLen 8192"
    else:  # grown: less than a block and u's rounding left
        assert budget - total < block + math.ceil(T / 10_000) and kv > two
        assert d["kv_cache"]["granted_by"] == ("the room left, between the default request: 2 x maxModelLen 8192 "
                                               "and the limit maxNumSeqs 256 x maxModelLen 8192")
    code, out, _ = run(capsys, "estimate", "--model", model, "--gpu", gpu, "--max-model-len", "8192",
                       "--default-kv-grant", rule)
    assert code == 0 and f"KV cache: {granted} tokens" in out  # the grant, which --kv-cache-tokens gives back
    assert f"KV grant: {granted:,} tokens ({d['kv_cache']['granted_by']})" in out


def test_the_requests_grant_on_an_l4_by_hand(capsys):
    """The L4 case, by hand. Qwen2.5-7B bf16 at 8k: the request, 2 requests x 512 blocks + 1 null
    block of 917,504 B = 940,441,600 B, 16,384 tokens; the fair share (1/8 of the 20.3 GiB budget) is
    below its weights, so that is its grant. Llama-3.1-8B: 1,025 blocks x 2 MiB, 16,384 tokens, inside
    the 1,089 blocks the room left would hold. `room` grants Llama-3.1-8B the room left: 1,089 blocks,
    (1,089 - 1) x 16 = 17,408 tokens, below its limit of 256 x 8192."""
    code, out, _ = run(capsys, "estimate", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "NVIDIA-L4",
                       "--max-model-len", "8192", "-o", "json")
    d = json.loads(out)
    assert code == 0 and d["per_gpu"]["kv_cache_bytes"] == (2 * 512 + 1) * 917_504 == 940_441_600
    assert d["kv_cache"]["granted_tokens"] == 16_384
    code, out, _ = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4",
                       "--max-model-len", "8192", "-o", "json")
    d = json.loads(out)
    assert code == 0 and d["per_gpu"]["kv_cache_bytes"] == 1025 * 16 * 131_072 and d["kv_cache"]["granted_tokens"] == 16_384
    assert d["kv_cache"]["granted_by"] == "default request: 2 x maxModelLen 8192"
    code, out, _ = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4",
                       "--max-model-len", "8192", "-o", "json", "--default-kv-grant", "room")
    d = json.loads(out)
    assert code == 0 and d["per_gpu"]["kv_cache_bytes"] == 1089 * 16 * 131_072 and d["kv_cache"]["granted_tokens"] == 17_408


def test_vllms_own_utilization_alone_on_an_l4_is_admitted(capsys):
    """Issue 31: --gpu-memory-utilization 0.9 uses ceil(0.9 T) + its CUDA context outside R, exactly the
    counted budget."""
    argv = ["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4", "--max-model-len", "8192",
            "--gpu-memory-utilization", "0.9", "-o", "json"]
    code, out, _ = run(capsys, *argv)
    d = json.loads(out)
    T = COMMON_GPUS["NVIDIA-L4"]
    assert code == 0 and d["fits"]
    assert d["per_gpu"]["total_bytes"] == d["per_gpu"]["budget_bytes"] == math.ceil(0.9 * T) + int(0.55 * (1 << 30))


def test_a_utilization_above_vllms_default_on_an_l4_gets_a_checked_fix(capsys, monkeypatch):
    """--gpu-memory-utilization 0.92 books 0.55 GiB + ceil(0.92 T) > ceil(0.9 T) + 0.55 GiB. The fixes
    are each checked by running them."""
    monkeypatch.setenv("COLUMNS", "200")  # one fix per line
    argv = ["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4", "--max-model-len", "8192",
            "--gpu-memory-utilization", "0.92"]
    code, out, _ = run(capsys, *argv)
    assert code == 1
    fixes = [f.strip() for f in out.split("fits with (each checked):\n", 1)[1].splitlines() if f.startswith("  --")]
    assert fixes[0].startswith("--gpu-memory-utilization 0.9") and fixes[1].startswith("--budget-utilization 0.92 ")
    for fix in fixes:
        flags = fix.split(" (")[0].split()
        args = [a for a in argv if a not in ("--gpu-memory-utilization", "0.92")] if flags[0] == "--gpu-memory-utilization" \
            else argv
        code, out, _ = run(capsys, *args, *flags, "-o", "json")
        assert code == 0 and json.loads(out)["fits"], fix


def test_a_spec_only_adr_0002_refuses_is_offered_the_counted_policy(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one fix per line
    argv = ["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4", "--max-model-len", "8192",
            "--budget-policy", "adr-0002"]
    code, out, _ = run(capsys, *argv)
    assert code == 1
    fixes = [f.strip() for f in out.split("fits with (each checked):\n", 1)[1].splitlines() if f.startswith("  --")]
    assert fixes[0].startswith("--budget-policy counted (ceil(0.9 x capacity) + 0.55 GiB CUDA context; "
                               "now 0.9 x capacity - 2.0 GiB (adr-0002)")
    assert fixes.index(fixes[0]) < fixes.index("--quantization fp8")  # the policy before quantization
    code, out, _ = run(capsys, *argv[:-2], "--budget-policy", "counted", "-o", "json")
    assert code == 0 and json.loads(out)["fits"]
