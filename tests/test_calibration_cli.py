"""`vllmfit estimate --calibration` and `vllmfit plan --calibration` (issue 34): the operator's
learned records, read offline, book a configuration that over-ran with what it used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllmfit import main as cli
from vllmfit.core import defaults, placement
from vllmfit.core.memory import learned
from vllmfit.core.spec.api import VLLMDeployment

GIB = 1 << 30
QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
H100 = "NVIDIA-H100-80GB-HBM3"
ARGS = ["--model", QWEN7, "--max-model-len", "8192", "--kv-concurrency", "1"]


def _estimate(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert cli.main(["estimate", *ARGS, "-o", "json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _records(predicted: int, observed: int) -> dict:
    s = placement.settings_from_spec(VLLMDeployment.model_validate({
        "apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment", "metadata": {"name": "x"},
        "spec": {"model": QWEN7, "maxModelLen": 8192, "kvCache": {"concurrency": 1}}}).spec)
    rec = learned.record(QWEN7, H100, s, predicted, observed, "ml/qwen replica 0 on gpu-a GPU 0")
    return {"records": [rec.as_data()]}


@pytest.mark.parametrize("form", ["yaml", "configmap"])
def test_estimate_shows_the_corrected_figure_and_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            form: str) -> None:
    plain = _estimate(capsys)["per_gpu"]["total_bytes"]
    data = _records(plain, plain + 2 * GIB)
    if form == "configmap":  # what `kubectl get configmap vllmfit-calibration -o yaml` gives
        data = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": defaults.CALIBRATION_CONFIGMAP},
                "data": {defaults.CALIBRATION_KEY: json.dumps(data)}}
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    out = _estimate(capsys, "--calibration", str(path))
    assert out["per_gpu"]["total_bytes"] == plain + 2 * GIB
    assert (out["per_gpu"]["predicted_bytes"], out["per_gpu"]["learned_bytes"]) == (plain, 2 * GIB)
    assert any("(ml/qwen replica 0 on gpu-a GPU 0; cluster-wide)" in w for w in out["warnings"])
    assert cli.main(["estimate", *ARGS, "--calibration", str(path)]) == 0
    table = capsys.readouterr().out
    assert "learned over-run (--calibration)" in table and "2.0" in table
    # another configuration is not corrected
    assert cli.main(["estimate", "--model", QWEN7, "--max-model-len", "4096", "--kv-concurrency", "1", "-o", "json",
                     "--calibration", str(path)]) == 0
    assert "learned_bytes" not in json.loads(capsys.readouterr().out)["per_gpu"]


def test_plan_books_the_learned_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {
        "nvidia.com/gpu.product": H100, "nvidia.com/gpu.count": "1"}}}
    dep = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment", "metadata": {"name": "qwen", "namespace": "ml"},
           "spec": {"model": QWEN7, "maxModelLen": 8192, "kvCache": {"concurrency": 1}}}
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump_all([nodes, dep]))
    assert cli.main(["plan", "-f", str(cluster), "-o", "json"]) == 0
    before = json.loads(capsys.readouterr().out)
    plain = _booked(before)
    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump(_records(plain, plain + 3 * GIB)))
    assert cli.main(["plan", "-f", str(cluster), "-o", "json", "--calibration", str(cal)]) == 0
    after = json.loads(capsys.readouterr().out)
    assert _booked(after) == plain + 3 * GIB
    assert "used 3.0 GiB more at its first start" in json.dumps(after)


def _booked(plan: dict) -> int:
    text = json.dumps(plan)
    found = [int(v) for v in __import__("re").findall(r'"total_bytes": (\d+)', text)]
    assert found, text[:500]
    return found[0]


@pytest.mark.parametrize(("content", "message"), [
    ("records: [1]", "calibration record 0: not a mapping"),
    ("{kind: ConfigMap, data: {}}", "has no data key records.json"),
    ("records: [", "not YAML"),
    ('[{"model": "m"}]', "gpu must be a string"),
])
def test_a_bad_calibration_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        content: str, message: str) -> None:
    path = tmp_path / "cal.yaml"
    path.write_text(content)
    assert cli.main(["estimate", *ARGS, "--calibration", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
