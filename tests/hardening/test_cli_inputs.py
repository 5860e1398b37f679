"""Bad CLI input (issue 14, item 11): one line on stderr, exit code 2, no traceback; a closed
pipe is silent; deeply nested YAML and out-of-bounds statuses in `plan` are reported, not fatal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from vllmfit import main as cli

ROOT = Path(__file__).resolve().parents[2]
LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"
NODE = """apiVersion: v1
kind: Node
metadata:
  name: n1
  labels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.count: "1"}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllmfit: error: "), err
    return lines[0]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e400", "-3", "0", "1e9"])
def test_gpu_memory_gib_not_a_real_size(capsys, value: str) -> None:
    code, _, err = run(capsys, "estimate", "--model", LLAMA8, f"--gpu-memory-gib={value}")
    assert code == 2
    assert "--gpu-memory-gib" in one_line_error(err)


@pytest.mark.parametrize("value", ["-5", "0", str(10**15)])
def test_params_must_be_a_real_count(capsys, tmp_path: Path, value: str) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "intermediate_size": 14336}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "estimate", "--model-config", str(tmp_path), "--params", value)
    assert code == 2 and "--params" in one_line_error(err)


def test_unset_max_num_seqs_follows_a_small_batch(capsys) -> None:
    # max_num_seqs unset: vLLM's default S = min(S_default, B) (vllm-flags.md section 3): 1 here
    code, out, err = run(capsys, "estimate", "--model", LLAMA8, "--max-num-batched-tokens", "1", "--max-model-len",
                         "4096", "-o", "json")
    assert code in (0, 1) and err == ""
    assert json.loads(out)["flags"]["max_num_seqs"] == 1


@pytest.mark.parametrize("argv,needed", [
    (["--max-num-batched-tokens", "100", "--max-num-seqs", "256"], 256),
])
def test_batched_tokens_below_max_num_seqs(capsys, argv: list[str], needed: int) -> None:
    # vLLM SchedulerConfig: "max_num_batched_tokens (B) must be greater than or equal to max_num_seqs (S)."
    code, _, err = run(capsys, "estimate", "--model", LLAMA8, *argv)
    assert code == 2
    assert f"at least {needed}" in one_line_error(err)


def test_batched_tokens_equal_to_max_num_seqs_is_fine(capsys) -> None:
    code, _, err = run(capsys, "estimate", "--model", LLAMA8, "--max-num-batched-tokens", "256",
                       "--max-num-seqs", "256", "--max-model-len", "4096", "-o", "json")
    assert code in (0, 1) and err == ""


def test_closed_pipe_is_silent(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    # `vllmfit plan ... | head`: the reader is gone. A pipe whose read end is closed gives EPIPE
    # (BrokenPipeError) on write, as a shell pipe does once head exits.
    r, w = os.pipe()
    os.close(r)
    stream = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed by the test
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        code = cli.main(["plan", "-f", str(ROOT / "examples" / "cluster.yaml"), "--output", "json"])
    finally:
        monkeypatch.undo()
    assert code == 1  # a normal end: the plan's verdict (one deployment there fits nowhere), not 141 or rich's exit
    assert capsys.readouterr().err == ""
    stream.write("x" * 100_000)  # stdout now points at /dev/null: the final flush cannot fail again
    stream.close()


def _plan(capsys, tmp_path: Path, text: str) -> dict:
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    code, out, err = run(capsys, "plan", "-f", str(f), "--output", "json")
    plan = json.loads(out)
    # 2: an input error, each listed, the rest still planned; else 1: something is unschedulable (issue 24)
    assert code in ((2,) if plan["errors"] else (0, 1)), err
    return plan


def test_deeply_nested_yaml_is_one_error_not_a_crash(capsys, tmp_path: Path) -> None:
    # 100,000 levels crash libyaml's C composer (SIGSEGV) and give a RecursionError in the pure-Python one.
    d = 100_000
    deep = ("apiVersion: vllmfit.dev/v1alpha1\nkind: VLLMDeployment\nmetadata: {name: x}\n"
            f"spec:\n  model: org/x\n  modelConfig: {{a: {'[' * d}{']' * d}}}\n")
    plan = _plan(capsys, tmp_path, NODE + "---\n" + deep)
    assert plan["errors"] == ["%s document 2: nested more than 1000 levels deep; not read" % (tmp_path / "cluster.yaml")]
    assert plan["summary"]["nodes"] == 1


def test_cpu_only_nodes_in_an_export_are_not_errors(capsys, tmp_path: Path) -> None:
    cpu = "apiVersion: v1\nkind: Node\nmetadata:\n  name: cpu-1\n  labels: {kubernetes.io/os: linux}\n"
    plan = _plan(capsys, tmp_path, NODE + "---\n" + cpu)
    assert plan["errors"] == []
    assert plan["summary"]["nodes"] == 1


def test_negative_total_bytes_in_a_status_is_not_restored(capsys, tmp_path: Path) -> None:
    dep = f"""apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {{name: liar, creationTimestamp: "2026-01-01T00:00:00Z"}}
spec: {{model: {LLAMA8}, maxModelLen: 4096, maxNumSeqs: 1}}
status:
  phase: Admitted
  memory:
  - {{node: n1, index: 0, weightsBytes: 1, kvCacheBytes: 1, activationBytes: 1, overheadBytes: 1,
      totalBytes: -900000000000}}
"""
    plan = _plan(capsys, tmp_path, NODE + "---\n" + dep)
    [err] = plan["errors"]
    assert "status not restored" in err and "totalBytes" in err
    [gpu] = plan["gpus"]
    # decided again: its real footprint is booked, never a negative one
    assert all(s["bytes"] > 0 for s in gpu["segments"])
    assert gpu["used_bytes"] > 0


def test_no_internal_unlimited_value_in_messages(capsys, tmp_path: Path) -> None:
    # A footprint larger than 2^62 bytes was reported against the search's internal "unlimited"
    # room: "needs ... GiB per GPU, 4294967296.0 GiB free".
    dep = """apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {name: huge}
spec:
  model: org/huge
  maxModelLen: 67108864
  modelConfig: {architectures: [LlamaForCausalLM], model_type: llama, num_hidden_layers: 1024,
    hidden_size: 131072, num_attention_heads: 4096, num_key_value_heads: 4096, head_dim: 4096,
    vocab_size: 1000, max_position_embeddings: 67108864}
"""
    text = json.dumps(_plan(capsys, tmp_path, NODE + "---\n" + dep))
    assert "4294967296" not in text
    assert "more than any GPU has" in text


def test_a_name_the_operator_would_reject_is_an_error_in_plan(capsys, tmp_path: Path) -> None:
    dep = f"""apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {{name: Llama_8B}}
spec: {{model: {LLAMA8}, maxModelLen: 4096}}
"""
    plan = _plan(capsys, tmp_path, NODE + "---\n" + dep)
    [err] = plan["errors"]
    assert "metadata.name 'Llama_8B' must be a DNS label" in err
    assert plan["deployments"] == []
