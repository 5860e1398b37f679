"""`vllmfit plan` as a CI gate: 0 all fit, 1 something does not fit, 2 any input error, each error
on one line of its own on stderr and the rest still planned; output to a pipe or a file is never
wrapped; a reader that leaves early (`plan | head`) is a normal end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllmfit import main as cli

ROOT = Path(__file__).resolve().parents[1]
NODE = """apiVersion: v1
kind: Node
metadata:
  name: gpu-a
  labels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.count: "1"}
"""
GOOD = """apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {name: good}
spec: {model: meta-llama/Llama-3.1-8B-Instruct, maxModelLen: 8192, kvCache: {tokens: 20000}}
"""


def dep(name: str, spec: str, kind: str = "VLLMDeployment") -> str:
    return f"apiVersion: vllmfit.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: {name}}}\nspec: {spec}\n"


BAD = {  # case -> (document, what its error line says)
    "misspelt field": (dep("typo", "{model: meta-llama/Llama-3.1-8B-Instruct, maxModelLenn: 8192}"),
                       "spec.maxModelLenn: unknown field; did you mean maxModelLen?"),
    "unknown model": (dep("unknown", "{model: no-such-model}"), "unknown model 'no-such-model'"),
    "negative maxModelLen": (dep("neg", "{model: meta-llama/Llama-3.1-8B-Instruct, maxModelLen: -5}"),
                             "spec.maxModelLen: Input should be greater than or equal to"),
    "malformed YAML": ("apiVersion: vllmfit.dev/v1alpha1\nkind: VLLMDeployment\nmetadata: {name: broken\n",
                       "not valid YAML"),
    "wrong kind": (dep("wrongkind", "{model: meta-llama/Llama-3.1-8B-Instruct}", kind="VLLMDeploymnt"),
                   "unknown kind 'VLLMDeploymnt'"),
}


def plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, *docs: str, output: str = "table") -> tuple[int, str]:
    code, out, _ = plan_err(capsys, tmp_path, *docs, output=output)
    return code, out


def plan_err(capsys: pytest.CaptureFixture[str], tmp_path: Path, *docs: str,
             output: str = "table") -> tuple[int, str, str]:
    f = tmp_path / "in.yaml"
    f.write_text("---\n".join(docs))
    code = cli.main(["plan", "-f", str(f), "-o", output])
    got = capsys.readouterr()
    return code, got.out, got.err


ERROR = "vllmfit plan: error: "


@pytest.mark.parametrize("case", BAD)
def test_each_bad_input_exits_2_with_one_error_line_and_the_rest_planned(
        case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc, says = BAD[case]
    code, out, err = plan_err(capsys, tmp_path, NODE, doc, GOOD)
    assert code == 2
    errors = err.splitlines()  # on stderr only, one line each: `> plan.txt` does not hide them
    assert len(errors) == 1 and errors[0].startswith(ERROR) and says in errors[0], err
    assert "error:" not in out
    assert "1 admitted; 1 input error (on stderr)" in out.splitlines()[0]  # the good one is still planned
    assert "Admitted      " in out and "default/good" in out


def test_all_bad_inputs_at_once_are_listed_one_line_each(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = plan_err(capsys, tmp_path, NODE, *(doc for doc, _ in BAD.values()), GOOD)
    assert code == 2
    errors = err.splitlines()
    assert len(errors) == len(BAD) and all(ln.startswith(ERROR) for ln in errors)
    for _, says in BAD.values():
        assert sum(says in ln for ln in errors) == 1, says
    code, out, err = plan_err(capsys, tmp_path, NODE, *(doc for doc, _ in BAD.values()), GOOD, output="json")
    assert code == 2 and len(json.loads(out)["errors"]) == len(BAD) == len(err.splitlines())


def test_errors_only_read_well(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = plan_err(capsys, tmp_path, NODE, BAD["misspelt field"][0])
    assert code == 2 and len(err.splitlines()) == 1
    assert out.splitlines()[0] == "1 node, 1 GPU (0 in use), 0 deployments; 1 input error (on stderr)"


def test_0_when_all_fit_1_when_one_does_not(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert plan(capsys, tmp_path, NODE, GOOD)[0] == 0
    too_big = dep("huge", "{model: meta-llama/Llama-3.1-405B-Instruct, maxModelLen: 8192}")
    assert plan(capsys, tmp_path, NODE, GOOD, too_big)[0] == 1


def test_the_help_says_what_each_exit_code_means(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 every deployment fits; 1 any does not fit; 2 any input error" in text


def _run(args: list[str], stdout: int | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"}
    return subprocess.Popen([sys.executable, "-m", "vllmfit", *args], cwd=ROOT, stdout=stdout or subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)



def big_input(tmp_path: Path) -> Path:
    """The example cluster eight times over: far more output than a pipe buffers (64 KiB)."""
    text = (ROOT / "examples" / "cluster.yaml").read_text()
    f = tmp_path / "big.yaml"
    f.write_text("\n---\n".join([text] * 8))
    return f


@pytest.mark.parametrize("output", ["table", "json", "html"])
def test_a_reader_that_leaves_early_is_a_normal_end(output: str, tmp_path: Path) -> None:
    # `vllmfit plan ... | head -1`: the verdict stands (2 here: the copies are duplicates), no
    # traceback, no 141 and not rich's own exit status 1
    p = _run(["plan", "-f", str(big_input(tmp_path)), "-o", output])
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 2 and err and all(ln.startswith(ERROR) for ln in err.splitlines())


def test_output_to_a_file_or_pipe_is_never_wrapped(tmp_path: Path) -> None:
    p = _run(["plan", "-f", str(ROOT / "examples" / "cluster.yaml")])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    lines = out.decode().splitlines()
    flags = [ln for ln in lines if "--gpu-memory-utilization=" in ln]
    assert flags and all("--max-num-batched-tokens=" in ln and "--max-model-len=" in ln for ln in flags)
    assert max(map(len, lines)) > 80  # COLUMNS=80 is not a terminal's width here
    assert "\x1b[" not in out.decode()  # no colour codes in a pipe
