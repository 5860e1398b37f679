"""Sharing through the real operator on KMock: the example files `vllmfit plan` and the webhook are
tested with (tests/placement/test_share_by_default.py, tests/placement/test_fair_share.py,
tests/webhook/test_webhook_sharing.py), applied one by one, in their order and in reverse. The
operator admits the set `plan` admits, each with a KV grant between its request and its limit
(status.kvCache: requestTokens <= tokens <= limitTokens = maxNumSeqs x maxModelLen, in whole blocks)."""

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


def planned(capsys: pytest.CaptureFixture[str], name: str) -> set[str]:
    main(["plan", "-f", str(EXAMPLES / name), "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    return {d["name"] for d in out["deployments"] if d["phase"] == "Admitted"}


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("example", ["six-small.yaml", "mixed.yaml", "six-llama-1b.yaml", "four-small.yaml",
                                     "eight-qwen-15b.yaml"])
async def test_the_operator_admits_what_plan_admits_in_either_order(cluster: Cluster, operator: Operator,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    example: str, reverse: bool) -> None:
    nodes, deps = objects(example)
    for n in nodes:
        await cluster.create(n)
    got: dict[str, tuple[str, int]] = {}
    for d in reversed(deps) if reverse else deps:
        await cluster.create(d)
        name, ns = d["metadata"]["name"], d["metadata"]["namespace"]
        await cluster.until(lambda n=name, s=ns: cluster.status(n, s).get("phase") == "Admitted", 30,
                            f"{ns}/{name} to be admitted, is {cluster.status(name, ns).get('phase')}")
        await cluster.store.writer.flush()
        st = cluster.status(name, ns)
        kv, flags = st["kvCache"], st["flags"]
        assert kv["requestTokens"] <= kv["tokens"] <= kv["limitTokens"]
        assert kv["limitTokens"] >= flags["maxNumSeqs"] * flags["maxModelLen"] and kv["concurrencyAtMaxModelLen"] >= 1
        got[f"{ns}/{name}"] = (st["placement"][0]["node"], st["placement"][0]["gpus"][0]["index"])
    assert set(got) == planned(capsys, example)
    if example in ("six-small.yaml", "mixed.yaml"):
        assert max(Counter(got.values()).values()) >= 4
