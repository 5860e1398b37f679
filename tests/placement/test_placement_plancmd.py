"""`vllmfit plan` input handling and `vllmfit status` with a fake API: per-document errors, Lists,
stdin, kept bookings, inline and ConfigMap model configs, determinism under shuffling."""

from __future__ import annotations

import argparse
import io
import json
import random
import re

import pytest
import yaml
from kubernetes.client import V1Node, V1NodeList, V1ObjectMeta

from vllmfit import main as cli
from vllmfit.cli import documents
from vllmfit.cli import status as statuscmd
from vllmfit.core import defaults
from vllmfit.core.observe.inventory import GpuInventory, InventoryGpu, InventoryProcess

H100_LABELS = {defaults.GFD_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3", defaults.GFD_COUNT_LABEL: "2"}


def _node(name: str, labels: dict | None = None, annotations: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels if labels is not None else H100_LABELS,
            "annotations": annotations or {},
        },
    }


def _dep(
    name: str,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    ns: str = "default",
    created: str = "2025",
    status: dict | None = None,
    **spec: object,
) -> dict:
    obj = {
        "apiVersion": "vllmfit.dev/v1alpha1",
        "kind": "VLLMDeployment",
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
        "spec": {"model": model, "maxModelLen": 8192, "kvCache": {"concurrency": 4}, **spec},
    }
    if status:
        obj["status"] = status
    return obj


def _stream(*docs: dict | str) -> str:
    return "\n---\n".join(d if isinstance(d, str) else yaml.safe_dump(d) for d in docs)


def _plan_json(tmp_path, text: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict, str]:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    rc = cli.main(["plan", "-f", str(path), "--output", "json", *extra])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else {}), err  # 0, 1 and 2 (input errors) all print the plan


def test_bad_documents_are_reported_by_name_and_the_rest_is_planned(tmp_path, capsys) -> None:
    text = _stream(
        _node("good"),
        "kind: Node\nmetadata: {name: broken\n",  # malformed YAML
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}},
        _node("cpu-only", labels={}),
        _dep("ok"),
        _dep("ghost", model="no-such/model-7b"),
        _dep("typo", tensorParallelSize="two"),
    )
    rc, data, _ = _plan_json(tmp_path, text, capsys)
    assert rc == 2  # input errors: each listed, the rest still planned (issue 31; it exited 0)
    errors = data["errors"]
    assert len(errors) == 3  # the CPU-only node is no error (issue 14): it has no GPUs to plan on
    assert any("document 2: not valid YAML" in e for e in errors)
    # a Kubernetes object of a kind plan does not use is ignored with a note (issue 24)
    assert any("document 3: Pod p ignored (plan reads Node, VLLMDeployment" in w for w in data["warnings"])
    assert not any("cpu-only" in e for e in errors)
    assert any(
        e.startswith("VLLMDeployment default/ghost (") and "unknown model 'no-such/model-7b'" in e
        for e in errors
    )
    assert any(
        e.startswith("VLLMDeployment default/typo (") and "spec.tensorParallelSize" in e for e in errors
    )
    assert [(d["name"], d["phase"]) for d in data["deployments"]] == [("default/ok", "Admitted")]
    assert [g["node"] for g in data["gpus"]] == ["good", "good"]


def test_nothing_to_plan_is_exit_2_with_one_line(tmp_path, capsys) -> None:
    rc, _, err = _plan_json(tmp_path, "kind: Pod\nmetadata: {name: x}\n", capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("vllmfit: error: nothing to plan")


def test_a_missing_file_is_exit_2(tmp_path, capsys) -> None:
    assert cli.main(["plan", "-f", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.startswith("vllmfit: error: cannot read")


def test_a_kubectl_list_from_stdin_and_a_second_file(tmp_path, capsys, monkeypatch) -> None:
    listing = {"apiVersion": "v1", "kind": "List", "items": [_node("a"), _dep("x")]}
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(listing)))
    second = tmp_path / "more.yaml"
    second.write_text(_stream(_node("b"), _dep("y", created="2026")))
    assert cli.main(["plan", "-f", "-", "-f", str(second), "--output", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({g["node"] for g in data["gpus"]}) == ["a", "b"]
    assert [d["phase"] for d in data["deployments"]] == ["Admitted", "Admitted"]


def test_admitted_deployments_keep_their_bookings(tmp_path, capsys) -> None:
    memory_entry = {
        "node": "a",
        "index": 1,
        "replica": 0,
        "weightsBytes": 40 << 30,
        "kvCacheBytes": 20 << 30,
        "activationBytes": 1 << 30,
        "overheadBytes": 2 << 30,
        "totalBytes": 63 << 30,
    }
    running = _dep(
        "old",
        created="2020",
        status={
            "phase": "Running",
            "memory": [memory_entry],
            "flags": {"maxModelLen": 8192, "maxNumSeqs": 4, "gpuMemoryUtilization": 0.8},
        },
    )
    rc, data, _ = _plan_json(tmp_path, _stream(_node("a"), running, _dep("new")), capsys)
    assert rc == 0
    new, old = data["deployments"]  # sorted by name
    assert (old["name"], old["kept"], old["node"], old["gpus"]) == ("default/old", True, "a", [1])
    assert old["flags"]["max_model_len"] == 8192
    gpu1 = next(g for g in data["gpus"] if g["index"] == 1)
    assert gpu1["used_bytes"] == 63 << 30  # 40 + 20 + 1 + 2 GiB, exactly as the status says
    assert new["gpus"] == [0]  # GPU 1 has 69.3 - 63 = 6.3 GiB left: too little for the new one


def test_vllmfit_pods_are_not_foreign_other_processes_are(tmp_path, capsys) -> None:
    inv = GpuInventory(
        sampled_at="2025-01-01T00:00:00Z",
        gpus=[
            InventoryGpu(
                index=0,
                uuid="GPU-0",
                product="NVIDIA-H100-80GB-HBM3",
                total_bytes=85520809984,
                used_bytes=30 << 30,
                processes=[
                    InventoryProcess(pid=1, used_bytes=20 << 30, pod_uid="ours"),
                    InventoryProcess(pid=2, used_bytes=10 << 30, pod_uid="theirs"),
                ],
            )
        ],
    )
    node = _node(
        "a", labels={}, annotations={defaults.INVENTORY_ANNOTATION: inv.model_dump_json(by_alias=True)}
    )
    mine = _dep("mine", status={"phase": "Pending", "podUids": ["ours"]})
    rc, data, _ = _plan_json(tmp_path, _stream(node, mine), capsys)
    assert rc == 0
    assert data["gpus"][0]["foreign_bytes"] == 10 << 30


def test_inline_model_config_and_configmap_ref(tmp_path, capsys) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cfg", "namespace": "default"},
        "data": {"config.json": json.dumps(cfg)},
    }
    text = _stream(
        _node("a"),
        cm,
        _dep("inline", model="acme/tiny", modelConfig=cfg),
        _dep("ref", model="acme/tiny", modelConfigRef={"name": "cfg"}),
        _dep("missing", model="acme/tiny", modelConfigRef={"name": "nope"}),
    )
    rc, data, _ = _plan_json(tmp_path, text, capsys)
    assert rc == 2  # the missing ConfigMap is an input error
    assert [(d["name"], d["phase"]) for d in data["deployments"]] == [
        ("default/inline", "Admitted"),
        ("default/ref", "Admitted"),
    ]
    assert [re.sub(r" \(.*?\)", "", e, count=1) for e in data["errors"]] == [
        # the one resolver's line, as the webhook and the operator say it (issue 29)
        "VLLMDeployment default/missing: spec.modelConfigRef: ConfigMap default/nope not found"
    ]


def test_shuffled_documents_give_the_same_json(tmp_path, capsys) -> None:
    docs = [
        _node("a"),
        _node("b"),
        _node("c", labels={defaults.GFD_PRODUCT_LABEL: "NVIDIA-L4", defaults.GFD_COUNT_LABEL: "1"}),
    ]
    docs += [_dep(f"d{i}", created=f"2025-01-{i + 1:02d}", maxModelLen=4096 * (1 + i % 4)) for i in range(9)]
    docs += [_dep("bad", model="nope/nope"), {"kind": "Secret", "metadata": {"name": "s"}}]
    outputs, errors = set(), set()
    for seed in range(4):
        random.Random(seed).shuffle(docs)
        rc, data, _ = _plan_json(tmp_path, _stream(*docs), capsys)
        assert rc == 2  # the unknown model and the kindless Secret are input errors
        # an error names the document's position, which shuffling changes; nothing else may change
        errors.add(tuple(sorted(re.sub(r"document \d+", "document N", e) for e in data.pop("errors"))))
        outputs.add(json.dumps(data, sort_keys=True))
    assert len(outputs) == 1 and len(errors) == 1


# --- status, with a fake API ------------------------------------------------------------------


class FakeCore:
    def __init__(self, nodes: list[V1Node]):
        self.nodes = nodes

    def list_node(self) -> V1NodeList:
        return V1NodeList(items=self.nodes)


class FakeCustom:
    def __init__(self, items: list[dict]):
        self.items = items
        self.calls: list[tuple] = []

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> dict:
        self.calls.append((group, version, plural))
        return {"items": self.items}


def test_status_draws_the_ledger_from_status_fields(capsys) -> None:
    entry = {
        "node": "a",
        "index": 0,
        "replica": 0,
        "weightsBytes": 16 << 30,
        "kvCacheBytes": 8 << 30,
        "activationBytes": 1 << 30,
        "overheadBytes": 2 << 30,
        "totalBytes": 27 << 30,
    }
    items = [
        _dep("run", status={"phase": "Running", "memory": [entry]}),
        _dep(
            "wait",
            status={
                "phase": "Unschedulable",
                "reasons": ["a: GPU 0 needs 90.0 GiB, 42.3 GiB free"],
                "suggestions": ["maxModelLen: 4096"],
            },
        ),
    ]
    core = FakeCore([V1Node(metadata=V1ObjectMeta(name="a", labels=H100_LABELS))])
    custom = FakeCustom(items)
    args = argparse.Namespace(kubeconfig=None, context=None, output="json", out_file=None)
    assert statuscmd.run_status(args, core, custom) == 0
    data = json.loads(capsys.readouterr().out)
    assert custom.calls == [("vllmfit.dev", "v1alpha1", "vllmdeployments")]
    run, wait = data["deployments"]
    assert (run["phase"], run["kept"], run["gpus"]) == ("Admitted", True, [0])
    assert (wait["phase"], wait["reasons"], wait["suggestions"]) == (
        "Unschedulable",
        ["a: GPU 0 needs 90.0 GiB, 42.3 GiB free"],
        ["maxModelLen: 4096"],
    )
    assert data["gpus"][0]["used_bytes"] == 27 << 30


def test_status_reports_api_failures_as_one_line(capsys) -> None:
    class Broken(FakeCore):
        def list_node(self) -> V1NodeList:
            raise ConnectionRefusedError("connection refused\nretrying")

    args = argparse.Namespace(kubeconfig=None, context=None, output="table", out_file=None)
    with pytest.raises(cli.UserError, match="^cannot read the cluster: connection refused$"):
        statuscmd.run_status(args, Broken([]), FakeCustom([]))


def test_status_renders_a_table(capsys) -> None:
    core = FakeCore([V1Node(metadata=V1ObjectMeta(name="a", labels=H100_LABELS))])
    args = argparse.Namespace(kubeconfig=None, context=None, output="table", out_file=None)
    assert statuscmd.run_status(args, core, FakeCustom([])) == 0
    assert "a: 2x H100-80GB-HBM3" in capsys.readouterr().out


def test_split_documents_keeps_each_document_apart_with_its_line() -> None:
    # line 1 a comment, line 2 "---", line 3 "a: 1", line 4 "--- # x", line 5 "b: 2", line 6 "---"
    text = "# c\n---\na: 1\n--- # x\nb: 2\n---\n\n"
    assert documents.split_documents(text) == [(2, "\na: 1\n"), (4, "\nb: 2\n")]
