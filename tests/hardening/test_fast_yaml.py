"""The plan's YAML reader (issue 14, item 14): libyaml composes, vllmfit builds, and the result is
what yaml.load(..., Loader=yaml.CSafeLoader) gives, except that `managedFields` blocks, which
and a Node's `status`, which vllmfit never reads, are blanked out first with line numbers kept."""

from __future__ import annotations

import datetime
import os

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.cli import documents

scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12),
                   st.sampled_from(["yes", "no", "on", "0x1f", "1_000", "~", "", "2025-01-01", ".inf", "0o17",
                                    "12:30:00", "-", "- x", "managedFields:"]),
                   st.dates(), st.datetimes(timezones=st.just(datetime.UTC)))
data = st.recursive(scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.one_of(st.text(max_size=8), st.integers()), c, max_size=4), max_leaves=20)


@settings(max_examples=int(os.environ.get("VLLMFIT_FUZZ_EXAMPLES", "300")), deadline=None, database=None)
@given(data, st.sampled_from([False, True]))
def test_load_yaml_is_pyyaml_safe_load(value: object, flow: bool) -> None:
    text = yaml.dump(value, Dumper=yaml.CSafeDumper, default_flow_style=flow, allow_unicode=True)
    assert documents.load_yaml(text) == yaml.load(text, Loader=yaml.CSafeLoader)


def test_anchors_merge_keys_and_tags_follow_pyyaml() -> None:
    for text in ["a: &x [1, 2]\nb: *x\n", "base: &b {x: 1}\nm:\n  <<: *b\n  y: 2\n", "!!str 12", "a: !!int '12'",
                 "t: 2025-06-01T10:00:00Z\nq: '2025-06-01T10:00:00Z'\n"]:
        assert documents.load_yaml(text) == yaml.load(text, Loader=yaml.CSafeLoader)
    a = documents.load_yaml("a: &x [1, 2]\nb: *x\n")
    assert a["a"] is a["b"]  # shared, like PyYAML: an alias bomb costs no memory


def test_managed_fields_are_blanked_and_line_numbers_kept() -> None:
    text = """apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata:
    managedFields:
    - apiVersion: v1
      fieldsV1:
        f:metadata:
          f:labels: {}
      manager: kubelet

    - manager: gfd
    name: n1
    labels: {a: b}
  status: {}
"""
    blanked = documents.blank_unread(text)
    assert blanked.count("\n") == text.count("\n")
    assert "managedFields" not in blanked and "kubelet" not in blanked
    got = documents.load_yaml(blanked)
    want = yaml.load(text, Loader=yaml.CSafeLoader)
    del want["items"][0]["metadata"]["managedFields"]
    assert got == want
    # an error after the blanked block is reported on its real line
    broken = text.replace("status: {}", "status: {unclosed")
    try:
        yaml.load(broken, Loader=yaml.CSafeLoader)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1
    errs = documents.read_objects([("x.yaml", broken)]).errors
    assert errs and f"(line {line})" in errs[0], errs


def test_a_nodes_status_is_blanked_and_nothing_else() -> None:
    text = """apiVersion: v1
items:
- apiVersion: v1
  kind: Node
  metadata:
    labels: {nvidia.com/gpu.count: '8'}
    name: n1
  status:
    images:
    - names: [a, b]
      sizeBytes: 1
    nodeInfo: {kubeletVersion: v1.30.2}
- apiVersion: vllmfit.dev/v1alpha1
  kind: VLLMDeployment
  metadata: {name: d}
  spec: {model: org/m}
  status:
    phase: Admitted
- apiVersion: v1
  metadata: {name: n2}
  status:
    kept: because kind comes later
  kind: Node
kind: List
"""
    want = yaml.load(text, Loader=yaml.CSafeLoader)
    del want["items"][0]["status"]
    got = documents.load_yaml(documents.blank_unread(text))
    assert got == want
    assert got["items"][1]["status"] == {"phase": "Admitted"}  # a VLLMDeployment's status is read


def test_a_managed_fields_key_inside_a_value_is_not_touched() -> None:
    text = "data:\n  note: |\n    managedFields: kept as text\n  inline: {managedFields: [1]}\n"
    assert documents.load_yaml(documents.blank_unread(text)) == yaml.load(text, Loader=yaml.CSafeLoader)


def test_a_realistic_kubectl_export_plans_the_same_with_and_without_blanking(monkeypatch, capsys,
                                                                             tmp_path) -> None:
    import json
    import sys
    from pathlib import Path

    from vllmfit import main as cli

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import plan_scale
    finally:
        sys.path.pop(0)
    export = tmp_path / "export.yaml"
    export.write_text(plan_scale.kubectl_export(30, 60))  # managedFields, images, conditions, nodeInfo

    def run() -> dict:
        assert cli.main(["plan", "-f", str(export), "--output", "json"]) == 0
        return json.loads(capsys.readouterr().out)

    fast = run()
    monkeypatch.setattr(documents, "blank_unread", lambda text: text)
    monkeypatch.setattr(documents, "load_yaml", lambda text: yaml.load(text, Loader=yaml.SafeLoader))
    slow = run()
    assert fast == slow
    assert fast["summary"]["nodes"] == 30 and fast["summary"]["deployments"] == 60 and fast["errors"] == []
