"""`vllmfit plan -f examples/cluster.yaml`, the README's main command, in every output format."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vllmfit import main as cli

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "cluster.yaml")
GIB = 1 << 30
CTX = int(0.55 * GIB)  # one single-GPU vLLM process's CUDA context, outside its R


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["plan", "-f", EXAMPLE, *args]) == 1  # research/llama-70b-128k fits nowhere, on purpose
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def plan_json() -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", "-f", EXAMPLE, "--output", "json"]) == 1  # one unschedulable, like estimate
    return json.loads(out.getvalue())


def test_every_gpu_is_within_its_budget(plan_json: dict) -> None:
    assert plan_json["errors"] == []
    for g in plan_json["gpus"]:
        booked = sum(s["bytes"] for s in g["segments"])
        assert g["used_bytes"] == booked + g["foreign_bytes"]
        # the counted budget policy (the default), computed here: ceil(0.90 x capacity) + one CUDA context
        assert g["budget_bytes"] == math.ceil(0.9 * g["capacity_bytes"]) + CTX
        assert g["used_bytes"] <= g["budget_bytes"]
        assert g["headroom_bytes"] == g["budget_bytes"] - g["used_bytes"]


def test_the_impossible_one_is_unschedulable_with_reasons(plan_json: dict) -> None:
    d = {x["name"]: x for x in plan_json["deployments"]}["research/llama-70b-128k"]
    assert d["phase"] in ("Unschedulable", "Rejected")
    # grouped like the kube-scheduler: the one A100 node it may use is short of memory, the 3 others are
    # excluded by its nodeSelector
    # excluded by its nodeSelector; then the budget policy of the node it looked at
    # the budget left on the group: the least headroom of its four GPUs, as the plan reports them
    # (every request is placed before any grant grows: GPU 1's room went to dev/qwen3-8b's kvCache.grow after)
    left = min(g["headroom_bytes"] for g in plan_json["gpus"] if g["node"] == "gpu-a100-b" and g["index"] != 1)
    assert f"{left / GIB:.1f}" == "8.4"
    assert d["reasons"] == [
        ("1 GPU memory (needs at least 120.2 GiB on each of 4 GPUs, the best 4 have 8.4 GiB or more left each: "
        "gpu-a100-b GPU 0,1,2,3)"),
        "3 node(s) didn't match placement.nodeSelector",
    ]  # no budget policy line: 112 GiB short is not the policy's doing (it holds back 3.4 GiB of each GPU)
    assert d["gpus"] == [] and d["message"] == (
        "0/4 nodes are available: " + ", ".join(d["reasons"]) + ".")


def test_the_pinned_one_moves_with_a_warning(plan_json: dict) -> None:
    d = {x["name"]: x for x in plan_json["deployments"]}["chat/qwen-14b"]
    assert d["phase"] == "Admitted" and d["moved"]
    assert d["node"] != "gpu-l4-c"
    assert any(w.startswith("pinned placement does not fit (gpu-l4-c: GPU 1 needs") for w in d["warnings"])


def test_the_running_one_keeps_its_status_bookings(plan_json: dict) -> None:
    d = {x["name"]: x for x in plan_json["deployments"]}["search/bge-m3"]
    assert (d["kept"], d["node"], d["gpus"]) == (True, "gpu-l4-c", [0])
    gpu = next(g for g in plan_json["gpus"] if (g["node"], g["index"]) == ("gpu-l4-c", 0))
    # the status says 1136746752 + 0 + 123223654 + 1739422522 = 2999392928 bytes
    assert sum(s["bytes"] for s in gpu["segments"] if s["deployment"] == "search/bge-m3") == 2999392928


def test_foreign_use_and_mig_slices_of_the_inventory_node(plan_json: dict) -> None:
    gpus = {(g["node"], g["index"]): g for g in plan_json["gpus"]}
    assert gpus[("gpu-mixed-d", 1)]["foreign_bytes"] == 12884901888  # the notebook pod's 12 GiB
    assert ("gpu-mixed-d", 2) not in gpus  # MIG on: the slices are the units, 1000 x (2 + 1) + slice
    assert gpus[("gpu-mixed-d", 3000)]["capacity_bytes"] == 42144366592
    assert gpus[("gpu-mixed-d", 3001)]["label"] == "GPU 2 MIG 1"


def test_some_gpus_are_shared(plan_json: dict) -> None:
    shared = [g for g in plan_json["gpus"] if len({s["deployment"] for s in g["segments"]}) > 1]
    assert shared


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys)
    assert "gpu-h100-a: 8x H100-80GB-HBM3" in out
    assert "research/llama-70b-128k" in out and "Unschedulable" in out
    assert "warning: pinned placement does not fit" in out


def test_html_is_one_self_contained_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.html"
    assert cli.main(["plan", "-f", EXAMPLE, "-o", "html", "--out-file", str(target)]) == 1
    text = target.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text
    assert not re.search(r"""(src|href)=["']|<script|<link|@import|url\(""", text)
    for svg in re.findall(r"<svg.*?</svg>", text, re.DOTALL):
        ET.fromstring(svg)  # well-formed
    assert "research/llama-70b-128k" in text


def test_svg_output_is_one_image(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--output", "svg")
    root = ET.fromstring(out)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_json_is_byte_for_byte_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "--output", "json") == _run(capsys, "--output", "json")


@pytest.mark.parametrize("command", [["estimate", "--model", "x"], ["models"], ["gpus"], ["plan", "-f", "x"],
                                     ["status"], ["crd"]])
def test_dash_o_is_the_output_format_on_every_command_like_kubectl(command):
    args = cli.build_parser(command[0]).parse_args([*command, "-o", "json"])
    assert args.output == "json"
    if command[0] in ("plan", "status"):
        assert cli.build_parser(command[0]).parse_args([*command, "--out-file", "f"]).out_file == "f"


# --- every example plans; exit codes --------- ------------------------------------------------------

EXAMPLES = sorted(p for p in (Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml")
                  if "calibration" not in p.parts)  # examples/calibration: a calibration record, not objects
H100_NODE = """apiVersion: v1
kind: Node
metadata:
  name: gpu-1
  labels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.count: "1", nvidia.com/gpu.memory: "81559"}
"""


@pytest.mark.parametrize("example", [str(p.relative_to(Path(EXAMPLE).parent)) for p in EXAMPLES if p.name != "cluster.yaml"])
def test_every_example_plans_next_to_the_cluster_without_an_input_error(capsys, example: str) -> None:
    path = str(Path(EXAMPLE).parent / example)
    code = cli.main(["plan", "-f", EXAMPLE, "-f", path, "-o", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1  # the cluster's research/llama-70b-128k fits nowhere
    assert data["errors"] == []
    names = {d["name"] for d in data["deployments"]}
    assert len(names) > 13  # the cluster's 13 and the example's own


def test_a_kind_plan_does_not_use_is_ignored_with_a_note(capsys) -> None:
    code = cli.main(["plan", "-f", EXAMPLE, "-f", str(Path(EXAMPLE).parent / "model-cache.yaml"), "-o", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["errors"] == []
    assert any("PersistentVolumeClaim hf-model-cache ignored" in w for w in data["warnings"])


def test_deployments_without_nodes_say_so_and_exit_2(capsys) -> None:
    code = cli.main(["plan", "-f", str(Path(EXAMPLE).parent / "llama-8b.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("vllmfit: error: no GPU node in the input to place 1 VLLMDeployment(s) on")
    assert "0/0 nodes" not in err


def test_exit_0_when_everything_fits_and_1_when_anything_does_not(tmp_path: Path, capsys) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(H100_NODE)
    fits = str(Path(EXAMPLE).parent / "llama-8b.yaml")  # about 25 GiB: fits one H100
    assert cli.main(["plan", "-f", str(nodes), "-f", fits, "-o", "json"]) == 0
    capsys.readouterr()
    too_big = str(Path(EXAMPLE).parent / "llama-70b-too-big.yaml")
    assert cli.main(["plan", "-f", str(nodes), "-f", fits, "-f", too_big, "-o", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert sorted(d["phase"] for d in data["deployments"]) == ["Admitted", "Unschedulable"]


def test_the_common_case_is_admitted_on_one_l4_with_the_room_as_kv_cache(tmp_path: Path, capsys) -> None:
    """Llama-3.1-8B bf16 at 8k on an empty L4 is admitted by `plan` too (the counted budget). With no
    kvCache it gets its request, 2 x 8192 tokens (2 x 512 blocks of 16 x 128 KiB + the null block:
    a fair share, 1/8 of the budget, is below its weights); with `--default-kv-grant room` the room
    left (whole blocks), at least 8192 tokens."""
    f = tmp_path / "l4.yaml"
    f.write_text("""apiVersion: v1
kind: Node
metadata:
  name: l4
  labels: {nvidia.com/gpu.product: NVIDIA-L4, nvidia.com/gpu.count: "1", nvidia.com/gpu.memory: "23034"}
---
apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {name: chat, namespace: default}
spec: {model: meta-llama/Llama-3.1-8B-Instruct, maxModelLen: 8192}
""")
    assert cli.main(["plan", "-f", str(f), "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [d] = data["deployments"]
    assert d["phase"] == "Admitted" and d["per_gpu"]["kv_cache_bytes"] == (2 * 512 + 1) * 16 * 131072
    assert cli.main(["plan", "-f", str(f), "-o", "json", "--default-kv-grant", "room"]) == 0
    data = json.loads(capsys.readouterr().out)
    [g] = data["gpus"]
    [d] = data["deployments"]
    assert d["phase"] == "Admitted" and g["budget_bytes"] == math.ceil(0.9 * g["capacity_bytes"]) + CTX
    kv = d["per_gpu"]["kv_cache_bytes"]
    assert kv % (16 * 131072) == 0 and kv // 131072 - 16 >= 8192  # one null block held back (vLLM 0.33)
    assert 0 <= g["headroom_bytes"] < 16 * 131072 + math.ceil(g["capacity_bytes"] / 10_000)


def test_vllms_own_default_utilization_alone_on_an_empty_h100_is_admitted(tmp_path: Path, capsys) -> None:
    """Issue 31: u 0.9 books ceil(0.9 T) + its CUDA context, exactly the counted budget (it was refused:
    71.8 GiB against 0.9 x T = 71.3 GiB)."""
    f = tmp_path / "h100.yaml"
    f.write_text("""apiVersion: v1
kind: Node
metadata: {name: h100, labels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.count: "1"}}
---
apiVersion: vllmfit.dev/v1alpha1
kind: VLLMDeployment
metadata: {name: u9}
spec: {model: meta-llama/Llama-3.1-8B-Instruct, gpuMemoryUtilization: 0.9, maxModelLen: 8192}
""")
    assert cli.main(["plan", "-f", str(f), "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [g], [d] = data["gpus"], data["deployments"]
    assert d["phase"] == "Admitted" and g["used_bytes"] == g["budget_bytes"] == math.ceil(0.9 * 85031714816) + CTX


def test_html_names_the_rule_that_granted_each_kv_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33: the HTML report, like the text and JSON, says which rule granted the KV cache (the
    six-small example: maxNumSeqs 4 x maxModelLen 1024 = 4,096 tokens each)."""
    target = tmp_path / "plan.html"
    six = str(Path(EXAMPLE).parent / "sharing" / "six-small.yaml")
    assert cli.main(["plan", "-f", six, "-o", "html", "--out-file", str(target)]) == 0
    assert target.read_text().count("4096 tokens (maxNumSeqs 4 x maxModelLen 1024)") == 6
