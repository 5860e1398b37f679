"""Issue 33 through the real operator on KMock: the example files `vllmfit plan` and the webhook are
tested with (tests/placement/test_share_by_default.py, tests/webhook/test_webhook_sharing.py),
applied one by one in their creation order. Every deployment is admitted where the plan puts it,
with the KV grant the plan gives it (maxNumSeqs x maxModelLen) and the rule in status.kvCache."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from opkit import Cluster, Operator

from vllmfit.main import main

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sharing"


def objects(name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The example's Nodes and VLLMDeployments as the API server stores them (KMock sets no metadata)."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    nodes, deps = [], []
    for d in docs:
        meta = {**d["metadata"], "uid": str(uuid.uuid4()), "resourceVersion": "1"}
        if d["kind"] == "Node":
            count = d["metadata"]["labels"]["nvidia.com/gpu.count"]
            nodes.append({**d, "metadata": meta, "status": {"capacity": {"nvidia.com/gpu": count}}})
        else:
            deps.append({**d, "metadata": {**meta, "generation": 1}})
    return nodes, deps


def planned(capsys: pytest.CaptureFixture[str], name: str) -> dict[str, tuple[str, int, int]]:
    main(["plan", "-f", str(EXAMPLES / name), "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    return {d["name"]: (d["replicas"][0]["node"], d["replicas"][0]["gpus"][0], d["kv_cache"]["granted_tokens"])
            for d in out["deployments"] if d["phase"] == "Admitted"}


@pytest.mark.parametrize("example", ["six-small.yaml", "mixed.yaml"])
async def test_the_operator_admits_every_example_where_plan_puts_it(cluster: Cluster, operator: Operator,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     example: str) -> None:
    nodes, deps = objects(example)
    for n in nodes:
        await cluster.create(n)
    got: dict[str, tuple[str, int, int]] = {}
    for d in deps:
        await cluster.create(d)
        name, ns = d["metadata"]["name"], d["metadata"]["namespace"]
        await cluster.until(lambda n=name, s=ns: cluster.status(n, s).get("phase") == "Admitted", 30,
                            f"{ns}/{name} to be admitted, is {cluster.status(name, ns).get('phase')}")
        await cluster.store.writer.flush()
        st = cluster.status(name, ns)
        kv, flags = st["kvCache"], st["flags"]
        assert kv["tokens"] == flags["maxNumSeqs"] * flags["maxModelLen"]
        assert kv["grantedBy"] == f"maxNumSeqs {flags['maxNumSeqs']} x maxModelLen {flags['maxModelLen']}"
        got[f"{ns}/{name}"] = (st["placement"][0]["node"], st["placement"][0]["gpus"][0]["index"], kv["tokens"])
    assert got == planned(capsys, example)
    assert max(Counter(where[:2] for where in got.values()).values()) >= 4
