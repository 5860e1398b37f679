"""`vllmfit plan` with ResourceSlices and ResourceClaims (kubectl get resourceslices,resourceclaims
-A -o yaml): the GPUs of a DRA node come from its slices, and the memory claims vllmfit did not
make consume is foreign use."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import yaml

from vllmfit import main as cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dra-cluster.yaml"
GIB, MIB = 1 << 30, 1 << 20


def plan(*paths: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", *[a for p in paths for a in ("-f", p)], "--output", "json"]) == 0
    return json.loads(out.getvalue())


def test_a_foreign_claim_is_foreign_use_and_named() -> None:
    p = plan(str(EXAMPLE))
    assert p["errors"] == []
    g0, g1 = p["gpus"]
    assert (g0["node"], g0["index"], g0["uuid"]) == ("h100-node-a", 0, "GPU-4f8e2a9c-1b3d-4e5f-8a7b-0c1d2e3f4a5b")
    assert (g0["foreign_bytes"], g1["foreign_bytes"]) == (40 * GIB, 0)  # the training job's consumedCapacity
    assert p["warnings"] == [("h100-node-a GPU 0: 40.0 GiB claimed by ResourceClaim research/training-job-gpus-7f2kq "
                             "(foreign use)")]
    [d] = p["deployments"]
    assert d["phase"] == "Admitted"
    booked = sum(s["bytes"] for s in g0["segments"])
    assert g0["used_bytes"] == booked + 40 * GIB <= g0["budget_bytes"]


def test_vllmfits_own_claims_are_not_foreign_and_a_whole_device_claim_takes_it_all(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    [claim] = [i for i in docs[0]["items"] if i["kind"] == "ResourceClaim"]
    claim["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "vllmfit", "vllmfit.dev/deployment": "qwen-7b",
                                   "vllmfit.dev/replica": "0"}
    whole = json.loads(json.dumps(claim))
    whole["metadata"] = {"name": "exclusive-job", "namespace": "research"}
    r = whole["status"]["allocation"]["devices"]["results"][0]
    r["device"] = "gpu-1"
    del r["consumedCapacity"]  # allocated without a share: the whole GPU
    docs[0]["items"].append(whole)
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    p = plan(str(f))
    g0, g1 = p["gpus"]
    assert g0["foreign_bytes"] == 40 * GIB  # vllmfit's claim, but nothing admitted books it: the excess counts
    assert g1["foreign_bytes"] == 81559 * MIB
    assert ("h100-node-a GPU 1: 79.6 GiB claimed by ResourceClaim research/exclusive-job (foreign use)"
            in p["warnings"])
