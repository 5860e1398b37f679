"""The generated VLLMDeployment CRD: in sync with the models, structural, and accepting/refusing
the same specs as the models.

No API server runs here (shared/testing.md, section 1), so the CRD's openAPIV3Schema is checked
with jsonschema.Draft4Validator (OpenAPI v3.0's `exclusiveMinimum: true` is Draft 4's), on a copy
"closed" the way the API server treats unknown fields under strict field validation, and its CEL
rules are evaluated with cel-python when that is installed. The kind e2e tests (e2e/) check the
same things against a real API server.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from vllmfit.cli import crdgen
from vllmfit.core.spec import api

ROOT = Path(__file__).resolve().parents[1]
GENERATED = crdgen.render_crd()
RENDERED = crdgen.rendered_files()
VERSION = GENERATED["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


# --- in sync ------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", crdgen.CRD_DIRS)
@pytest.mark.parametrize("name", sorted(RENDERED))
def test_committed_crd_is_up_to_date(directory, name):
    path = ROOT / directory / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run `make crds`"
    assert path.read_text() == RENDERED[name], (
        f"{path.relative_to(ROOT)} differs from what operator/vllmfit/core/spec/api.py generates: run `make crds`"
    )


def test_generation_is_deterministic():
    assert crdgen.rendered_files() == crdgen.rendered_files()
    assert yaml.safe_load(crdgen.to_yaml(GENERATED)) == GENERATED
    assert "&id" not in crdgen.to_yaml(GENERATED)  # no YAML anchors/aliases


def test_crd_check_command(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    crdgen.add_parser(parser.add_subparsers())

    def run(*argv):
        args = parser.parse_args(["crd", *argv, "--root", str(tmp_path)])
        return args.func(args)

    assert run("--check") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make crds" in err
    assert run("--write") == 0
    for d in crdgen.CRD_DIRS:
        assert sorted(p.name for p in (tmp_path / d).iterdir()) == sorted(crdgen.rendered_files())
    assert run("--check") == 0
    (tmp_path / "charts/vllmfit/crds" / crdgen.CRD_FILE).write_text("# edited by hand\n")
    assert run("--check") == 1
    capsys.readouterr()
    assert run() == 0
    assert yaml.safe_load(capsys.readouterr().out) == GENERATED


# --- the CRD object -----------------------------------------------------------------------------


def test_names_and_version():
    spec = GENERATED["spec"]
    assert GENERATED["metadata"]["name"] == "vllmdeployments.vllmfit.dev"
    assert spec["group"] == "vllmfit.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "VLLMDeployment",
        "listKind": "VLLMDeploymentList",
        "plural": "vllmdeployments",
        "singular": "vllmdeployment",
        "shortNames": ["vllmd"],
        "categories": ["vllmfit"],  # not "all": `kubectl get all` is for the built-in workloads
    }
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] and VERSION["storage"]


def test_scale_subresource():
    """kubectl scale / HPA read and write these paths (apiextensions CustomResourceSubresourceScale)."""
    assert VERSION["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    props = SCHEMA["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["readyReplicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"


def _column_field(path: str) -> dict[str, Any]:
    node = SCHEMA
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_printer_columns():
    cols = VERSION["additionalPrinterColumns"]
    # kubectl prints NAME first by itself, then the priority-0 columns upper-cased
    default = ["NAME"] + [c["name"].upper() for c in cols if c.get("priority", 0) == 0]
    wide = ["NAME"] + [c["name"].upper() for c in cols]
    assert default == ["NAME", "READY", "MODEL", "STATUS", "AGE"]
    assert wide == ["NAME", "READY", "MODEL", "STATUS", "AGE", "NODE", "GPUS", "MAX-LEN", "SEQS", "UTIL",
                    "KV-REQUEST", "KV-GRANT", "KV-LIMIT", "HEADROOM"]
    assert {c["name"]: (c["jsonPath"], c["type"], c.get("priority", 0)) for c in cols} == {
        "Ready": (".status.ready", "string", 0),
        "Model": (".spec.model", "string", 0),
        "Status": (".status.phase", "string", 0),
        "Age": (".metadata.creationTimestamp", "date", 0),
        "Node": (".status.node", "string", 1),
        "GPUs": (".status.gpuList", "string", 1),
        "Max-Len": (".status.flags.maxModelLen", "integer", 1),
        "Seqs": (".status.flags.maxNumSeqs", "integer", 1),
        "Util": (".status.flags.gpuMemoryUtilization", "number", 1),
        "KV-Request": (".status.kvCache.requestTokens", "integer", 1),
        "KV-Grant": (".status.kvCache.tokens", "integer", 1),
        "KV-Limit": (".status.kvCache.limitTokens", "integer", 1),
        "Headroom": (".status.headroom", "string", 1),
    }
    assert all("priority" not in c for c in cols if c["name"] in ("Ready", "Model", "Status", "Age"))
    # every column points at a field the schema has, of the column's type
    for c in cols:
        if c["jsonPath"].startswith(".metadata"):
            continue
        assert _column_field(c["jsonPath"])["type"] == c["type"], c["name"]
    # derived from one place
    assert cols == crdgen.printer_columns() and len(cols) == len(crdgen.COLUMNS)


# --- structural ---------------------------------------------------------------------------------

FORBIDDEN = {
    "$ref",
    "$defs",
    "definitions",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "title",
    "const",
    "patternProperties",
    "dependencies",
    "$schema",
    "nullable",
}


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(SCHEMA):
        where = path or "<root>"
        assert not FORBIDDEN & set(node), f"{where}: {sorted(FORBIDDEN & set(node))}"
        assert (
            "type" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
            or node.get("x-kubernetes-int-or-string")
        ), f"{where}: no type"
        assert not ("properties" in node and "additionalProperties" in node), f"{where}: both"
        assert not isinstance(node.get("additionalProperties"), bool), (
            f"{where}: boolean additionalProperties"
        )
        if "properties" in node or "additionalProperties" in node:
            assert node.get("type") == "object", where
        if "items" in node:
            assert node.get("type") == "array" and isinstance(node["items"], dict), where
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node:
                assert isinstance(node[key], bool) and ("minimum" if "Min" in key else "maximum") in node, (
                    where
                )
        if node.get("x-kubernetes-list-type") == "map":
            assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), where
        if node.get("x-kubernetes-list-type") == "set":
            assert node["items"]["type"] in ("string", "integer", "number", "boolean"), where
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_every_field_has_a_description():
    missing = [
        path
        for path, node in _walk(SCHEMA)
        if path
        and not path.endswith(("[]", "{}"))
        and not path.startswith(".metadata")
        and not node.get("description")
    ]
    assert not missing, f"fields without a description (kubectl explain): {missing}"


def test_defaults_are_valid_for_their_field():
    for path, node in _walk(SCHEMA):
        if "default" in node:
            jsonschema.Draft4Validator(_closed(node)).validate(node["default"])
    # a CRD default would hide the operator's configurable default image
    assert "default" not in SCHEMA["properties"]["spec"]["properties"]["image"]


def test_kept_extensions_and_maps():
    spec = SCHEMA["properties"]["spec"]["properties"]
    for name in ("modelConfig", "resources"):
        assert spec[name] == {**spec[name], "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert spec["env"]["items"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert spec["placement"]["properties"]["nodeSelector"]["additionalProperties"] == {"type": "string"}
    assert spec["gpuMemoryUtilization"] == {
        **spec["gpuMemoryUtilization"],
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1,
    }
    assert spec["dtype"]["enum"] == ["auto", "bfloat16", "float16", "float32"]
    assert spec["tensorParallelSize"]["default"] == 1


# --- validation: what the API server would accept ----------------------------------------------


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server applies it with strict field validation (kubectl's default):
    unknown fields are errors except under x-kubernetes-preserve-unknown-fields, and
    x-kubernetes-list-type: set means unique items."""
    schema = copy.deepcopy(schema)
    for _, node in _walk(schema):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-list-type") == "set":
            node["uniqueItems"] = True
    return schema


SPEC_VALIDATOR = jsonschema.Draft4Validator(_closed(SCHEMA["properties"]["spec"]))
OBJECT_VALIDATOR = jsonschema.Draft4Validator(_closed(SCHEMA))


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """The API server's structural defaulting (apiextensions defaulting.Default), for tests."""
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
        for name, value in obj.items():
            if name in schema.get("properties", {}):
                apply_defaults(value, schema["properties"][name])
            elif isinstance(schema.get("additionalProperties"), dict):
                apply_defaults(value, schema["additionalProperties"])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])
    return obj


GOOD_SPECS = {
    "minimal": {"model": "meta-llama/Llama-3.1-8B-Instruct"},
    "everything": {
        "model": "my-org/custom-13b",
        "modelConfig": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 40, "rope_scaling": None},
        "modelParams": 13_000_000_000,
        "image": "vllm/vllm-openai:v0.33.0",
        "dtype": "bfloat16",
        "quantization": "fp8",
        "kvCacheDtype": "fp8_e4m3",
        "tensorParallelSize": 2,
        "pipelineParallelSize": 1,
        "replicas": 2,
        "maxModelLen": 8192,
        "maxNumSeqs": 16,
        "maxNumBatchedTokens": 4096,
        "gpuMemoryUtilization": 0.45,
        "enforceEager": True,
        "placement": {
            "nodeName": "gpu-node-1",
            "gpuIndices": [2, 3],
            "allowReschedule": False,
            "policy": "spread",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
        "hfTokenSecretRef": {"name": "hf-token", "key": "token"},
        "env": [
            {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
        "extraArgs": ["--enable-prefix-caching"],
    },
    "config-ref": {"model": "my-org/custom", "modelConfigRef": {"name": "custom-config"}},
    "pipeline-pinned": {
        "model": "m",
        "tensorParallelSize": 2,
        "pipelineParallelSize": 2,
        "placement": {"nodeName": "n", "gpuIndices": [0, 1, 2, 3]},
    },
    "zero-replicas": {"model": "m", "replicas": 0},
    "utilization-one": {"model": "m", "gpuMemoryUtilization": 1},
}

# name -> (spec, what the schema or a CEL rule must refuse). "cel" cases pass the OpenAPI schema.
BAD_SPECS = {
    "missing-model": ({"dtype": "auto"}, "schema"),
    "empty-model": ({"model": ""}, "schema"),
    "tp-zero": ({"model": "m", "tensorParallelSize": 0}, "schema"),
    "tp-not-int": ({"model": "m", "tensorParallelSize": "two"}, "schema"),
    "pp-too-big": ({"model": "m", "pipelineParallelSize": 17}, "schema"),
    "utilization-1.5": ({"model": "m", "gpuMemoryUtilization": 1.5}, "schema"),
    "utilization-zero": ({"model": "m", "gpuMemoryUtilization": 0}, "schema"),
    "negative-replicas": ({"model": "m", "replicas": -1}, "schema"),
    "short-context": ({"model": "m", "maxModelLen": 8}, "schema"),
    "unknown-dtype": ({"model": "m", "dtype": "int4"}, "schema"),
    "unknown-quantization": ({"model": "m", "quantization": "q4_k_m"}, "schema"),
    "unknown-field": ({"model": "m", "gpus": 2}, "schema"),
    "unknown-nested-field": ({"model": "m", "placement": {"node": "n"}}, "schema"),
    "unknown-policy": ({"model": "m", "placement": {"policy": "random"}}, "schema"),
    "secret-without-name": ({"model": "m", "hfTokenSecretRef": {"key": "token"}}, "schema"),
    "extra-args-not-strings": ({"model": "m", "extraArgs": [1]}, "schema"),
    "duplicate-gpus": (
        {"model": "m", "tensorParallelSize": 2, "placement": {"nodeName": "n", "gpuIndices": [1, 1]}},
        "schema",
    ),
    "negative-gpu-index": ({"model": "m", "placement": {"nodeName": "n", "gpuIndices": [-1]}}, "schema"),
    "gpus-without-node": ({"model": "m", "placement": {"gpuIndices": [0]}}, "cel"),
    "gpus-vs-tp": (
        {"model": "m", "tensorParallelSize": 2, "placement": {"nodeName": "n", "gpuIndices": [0]}},
        "cel",
    ),
    "gpus-vs-tp-pp": (
        {
            "model": "m",
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "placement": {"nodeName": "n", "gpuIndices": [0, 1]},
        },
        "cel",
    ),
    "gpus-vs-default-tp": ({"model": "m", "placement": {"nodeName": "n", "gpuIndices": [0, 1]}}, "cel"),
    "both-configs": ({"model": "m", "modelConfig": {"a": 1}, "modelConfigRef": {"name": "c"}}, "cel"),
}


@pytest.mark.parametrize("name", sorted(GOOD_SPECS))
def test_good_spec_is_valid(name):
    spec = apply_defaults(copy.deepcopy(GOOD_SPECS[name]), SCHEMA["properties"]["spec"])
    SPEC_VALIDATOR.validate(spec)
    # and the models agree
    api.VLLMDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize("name", sorted(BAD_SPECS))
def test_bad_spec_is_refused(name):
    spec, by = BAD_SPECS[name]
    spec = apply_defaults(copy.deepcopy(spec), SCHEMA["properties"]["spec"])
    errors = list(SPEC_VALIDATOR.iter_errors(spec))
    if by == "schema":
        assert errors, f"the CRD schema accepts {spec}"
    else:
        assert not errors, [e.message for e in errors]
        assert cel_failures(spec), f"no CEL rule refuses {spec}"
    # the models refuse it too (the webhook's and the CLI's view agree with the API server's);
    # cross-field rules live in the webhook, and a few checks exist only in the CRD (MODEL_GAPS)
    if by == "schema" and name not in MODEL_GAPS:
        with pytest.raises(ValueError):
            api.VLLMDeploymentSpec.model_validate(spec)


MODEL_GAPS = {
    "duplicate-gpus": "api.PlacementSpec.gpu_indices has no uniqueness check (the CRD's list-type set does)",
    "negative-gpu-index": "api.PlacementSpec.gpu_indices items have no ge=0 (crdgen adds minimum: 0)",
}


def test_crd_defaults_match_the_models():
    """After the API server's defaulting, a minimal spec carries the models' defaults."""
    defaulted = apply_defaults({"model": "m"}, SCHEMA["properties"]["spec"])
    model = api.VLLMDeploymentSpec(model="m").model_dump(by_alias=True, exclude_none=True)
    model.pop("image")  # defaulted by the operator (VLLMFIT_DEFAULT_IMAGE), not by the API server
    model.pop("env"), model.pop("extraArgs")  # empty lists are not written into objects
    assert defaulted == model


def test_full_status_survives_pruning():
    """Everything the operator may write into .status is in the schema (else the server drops it)."""
    status = api.VLLMDeploymentStatus(
        phase="Running",
        observed_generation=3,
        vllm_version="0.33",
        node="gpu-1",
        gpu_list="0,1",
        placement=[
            {"replica": 0, "node": "gpu-1", "gpus": [{"index": 0, "uuid": "GPU-1", "product": "NVIDIA-H100"}]}
        ],
        flags={
            "max_model_len": 8192,
            "max_num_seqs": 8,
            "gpu_memory_utilization": 0.4123,
            "kv_cache_memory_bytes": 1 << 33,
            "max_num_batched_tokens": 2048,
        },
        memory=[
            {
                "node": "gpu-1",
                "index": 0,
                "replica": 0,
                "weights_bytes": 1,
                "kv_cache_bytes": 2,
                "activation_bytes": 3,
                "overhead_bytes": 4,
                "total_bytes": 10,
            }
        ],
        gpus=[{"node": "gpu-1", "index": 0, "budget_bytes": 100, "used_bytes": 90, "headroom_bytes": 10}],
        headroom="10 B",
        replicas=1,
        ready_replicas=1,
        ready="1/1",
        selector="app.kubernetes.io/managed-by=vllmfit,vllmfit.dev/deployment=x",
        observed=[
            {
                "node": "gpu-1",
                "index": 0,
                "used_bytes": 11,
                "predicted_bytes": 10,
                "drift_bytes": 1,
                "sampled_at": "2026-01-01T00:00:00Z",
            }
        ],
        kv_cache={"bytes": 1, "tokens": 16, "concurrency_at_max_model_len": 1.0, "typical_length": 8,
                  "concurrency_at_typical_length": 2.0},
        pod_uids=["u1"],
        reasons=["r"],
        suggestions=["s"],
        warnings=["w"],
        conditions=[
            {
                "type": "Admitted",
                "status": "True",
                "reason": "Fits",
                "message": "ok",
                "last_transition_time": "2026-01-01T00:00:00Z",
                "observed_generation": 3,
            }
        ],
    ).model_dump(by_alias=True, exclude_none=True)
    jsonschema.Draft4Validator(_closed(SCHEMA["properties"]["status"])).validate(status)
    # every field is set above: the dump has every property the schema has
    assert set(status) == set(SCHEMA["properties"]["status"]["properties"])


def _example_docs():
    docs = []
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == api.KIND:
                docs.append(pytest.param(doc, id=f"{path.name}:{doc['metadata']['name']}"))
    return docs


EXAMPLES = _example_docs()


@pytest.mark.skipif(not EXAMPLES, reason="examples/*.yaml holds no kind: VLLMDeployment document yet")
@pytest.mark.parametrize("doc", EXAMPLES or [None])
def test_examples_are_valid(doc):
    assert doc["apiVersion"] == f"{api.GROUP}/{api.VERSION}"
    obj = apply_defaults(copy.deepcopy(doc), SCHEMA)
    OBJECT_VALIDATOR.validate({k: v for k, v in obj.items() if k != "status"})
    assert not cel_failures(obj["spec"]), doc["metadata"]["name"]


# --- CEL rules ----------------------------------------------------------------------------------


def _rules_with_paths():
    for path, node in _walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule


def test_cel_rules_have_messages_and_sit_on_spec():
    rules = list(_rules_with_paths())
    assert {p for p, _ in rules} == {".spec", ".spec.placement"}
    for _, rule in rules:
        assert rule["message"] and "\n" not in rule["message"] and "\n" not in rule["rule"]


def _node_at(obj: dict[str, Any], path: str) -> Any:
    for part in path.strip(".").split(".")[1:]:  # path starts with .spec
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def cel_failures(spec: dict[str, Any]) -> list[str]:
    """Messages of the CRD's CEL rules that `spec` (already defaulted) breaks."""
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed: CEL rules not evaluated")
    env = celpy.Environment()
    failed = []
    for path, rule in _rules_with_paths():
        target = spec if path == ".spec" else _node_at(spec, path)
        if target is None:  # the API server runs a rule only where its field exists
            continue
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(target)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):  # false, or an error
            failed.append(rule["message"])
    return failed


@pytest.mark.parametrize("name", sorted(GOOD_SPECS))
def test_cel_rules_accept_good_specs(name):
    spec = apply_defaults(copy.deepcopy(GOOD_SPECS[name]), SCHEMA["properties"]["spec"])
    assert cel_failures(spec) == []
