"""The chart's day-two objects: the post-delete hook that releases vllmfit's finalizers on
`helm uninstall` (tests/operator/test_uninstall.py runs its command against the emulator), and
the Grafana dashboard ConfigMap (tests/operator/test_metrics_scrape.py checks its queries)."""

from __future__ import annotations

import json
from typing import Any

from .conftest import CHART, NAMESPACE, find, one

HOOK = "vllmfit-uninstall"
POST_DELETE = {"helm.sh/hook": "post-delete", "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded"}


def test_uninstall_hook_runs_after_the_operator_is_gone_with_its_own_rights(render: Any) -> None:
    docs = render()
    job = one(docs, "Job", HOOK)
    objs = [one(docs, "ServiceAccount", HOOK), one(docs, "ClusterRole", HOOK), one(docs, "ClusterRoleBinding", HOOK)]
    for d in [job, *objs]:
        assert POST_DELETE.items() <= d["metadata"]["annotations"].items(), d["kind"]
    # its RBAC exists before the Job starts (lower weight), and only for the hook's lifetime
    assert all(int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in objs)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == HOOK and pod["restartPolicy"] == "Never"
    [c] = pod["containers"]
    assert c["command"] == ["vllmfit", "operator"] and "--release-finalizers" in c["args"]
    assert c["image"] == one(docs, "Deployment", "vllmfit-operator")["spec"]["template"]["spec"]["containers"][0]["image"]
    role = one(docs, "ClusterRole", HOOK)
    assert role["rules"] == [{"apiGroups": ["vllmfit.dev"], "resources": ["vllmdeployments"],
                              "verbs": ["list", "patch"]}]
    binding = one(docs, "ClusterRoleBinding", HOOK)
    assert binding["roleRef"]["name"] == HOOK
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": HOOK, "namespace": NAMESPACE}]
    # not the operator's pods: the operator's NetworkPolicy and PDB do not select it
    labels = job["spec"]["template"]["metadata"]["labels"]
    selector = one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert not selector.items() <= labels.items()


def test_uninstall_hook_can_be_turned_off(render: Any) -> None:
    docs = render("default", "--set", "uninstall.releaseFinalizers=false")
    assert not [d for d in docs if d["metadata"]["name"] == HOOK]


def test_dashboard_config_map_for_the_grafana_sidecar(render: Any) -> None:
    assert not [d for d in find(render(), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    cm = one(render("service-monitor"), "ConfigMap", "vllmfit-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "vllmfit"}
    shipped = json.loads(cm["data"]["vllmfit.json"])
    assert shipped == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert shipped["uid"] == "vllmfit" and len(shipped["panels"]) >= 10
    titles = " ".join(p["title"] for p in shipped["panels"]).lower()
    for what in ("booked memory by deployment", "headroom", "drift", "admissions", "webhook latency"):
        assert what in titles, what
    [booked] = [p for p in shipped["panels"] if p["title"].startswith("Booked memory by deployment")]
    assert booked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_dashboard_needs_the_metrics_service(render: Any) -> None:
    docs = render("default", "--set", "metrics.dashboard.enabled=true", "--set", "metrics.enabled=false")
    assert not [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
