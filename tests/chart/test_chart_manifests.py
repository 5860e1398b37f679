"""What `helm template` renders: valid Kubernetes objects, least-privilege RBAC, hardened pods,
and the names/ports/flags the operator, the webhook configurations and the Services must agree on."""

from __future__ import annotations

import copy
import filecmp
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from vllmfit.core import defaults

from .conftest import CHART, NAMESPACE, ROOT, VALUE_SETS, find, one, pod_specs

KUBE_VERSIONS = ["1.29", "1.35"]
"""Oldest supported (Chart.yaml kubeVersion >=1.29: CEL CRD validation is GA there) and a recent one.
kubernetes-validate 1.37 ships schemas for 1.25-1.37."""

# Kinds kubernetes-validate has no schema for, and how each is checked instead.
CUSTOM_KINDS = {"ClusterKopfPeering", "Certificate", "Issuer", "ServiceMonitor", "PrometheusRule"}  # the last: promtool

OPERATOR = "vllmfit-operator"
AGENT = "vllmfit-agent"

EXPECTED_OPERATOR_ARGS = [
    "--namespace=$(POD_NAMESPACE)",
    "--webhook-port=9443",
    "--webhook-service=vllmfit-webhook",
    "--cert-secret=vllmfit-webhook-cert",
    "--validating-webhook=vllmfit-validate",
    "--mutating-webhook=vllmfit-default",
    "--webhook-timeout-seconds=5",  # the review budget is cut from it (issue 29)
    "--metrics-port=8080",
    "--health-port=8081",
    "--placement-backend=auto",
    "--budget-utilization=0.9",  # the counted budget policy, cluster-wide (values: budget; issue 24)
    "--budget-reserve=0",
    "--default-kv-grant=requests",  # the default KV grant of a spec without kvCache or maxNumSeqs (issue 33)
    "--default-kv-requests=2",
    "--kv-tenants-per-gpu=8",
    "--pod-security-level=restricted",  # what a podTemplate may reach (values: tenants; issue 30), MPS off
    "--allow-max-logprobs=20",  # vLLM's default bound on top logprobs (values: tenants.maxLogprobs)
    "--reservation-image=ghcr.io/vllmfit/vllmfit:0.1.0",
    "--reservation-priority-class=vllmfit-reservation",
    "--reservation-runtime-class=nvidia",
    "--reservation-service-account=vllmfit-reservation",
    "--dra-driver=gpu.nvidia.com",
    "--dra-device-class=gpu.nvidia.com",
    "--peering=vllmfit",
]


@pytest.fixture(scope="module")
def kube_validate():
    """kubernetes_validate.validate, with its schema files parsed once instead of on every call
    (its _definitions.json is several MB): ~10x faster over the whole matrix."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            kubernetes_validate.utils,
            "schema_contents",
            functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents),
        )
        yield kubernetes_validate.validate


def _container(docs, kind, name, container):
    spec = one(docs, kind, name)["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == container)


def _env(container):
    return {e["name"]: e for e in container.get("env", [])}


# --- every value set ---------------------------------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_manifests_validate_strict(render, kube_validate, value_set, kube_version):
    unknown = []
    for doc in render(value_set, "--kube-version", kube_version):  # what that version's cluster gets
        try:
            kube_validate(doc, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if doc["kind"] not in CUSTOM_KINDS:
                unknown.append(doc["kind"])
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata']['name']} invalid for {kube_version}: {e}"
            ) from e
    assert not unknown, f"kinds with no schema and no custom check: {unknown}"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_rbac_wildcards(render, value_set):
    for role in find(render(value_set), "ClusterRole") + find(render(value_set), "Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(field, []), f"{role['metadata']['name']}: '*' in {field}"
            assert not any("*" in r for r in rule.get("resources", [])), role["metadata"]["name"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_is_hardened(render, value_set):
    specs = list(pod_specs(render(value_set)))
    assert specs
    for where, spec in specs:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), where
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c.get("securityContext", {})
            ctx = f"{where}/{c['name']}"
            assert sc.get("runAsNonRoot") is True, ctx
            assert sc.get("readOnlyRootFilesystem") is True, ctx
            assert sc.get("allowPrivilegeEscalation") is False, ctx
            assert sc.get("privileged", False) is False, ctx
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], ctx
            assert not sc.get("capabilities", {}).get("add"), ctx
            assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", ctx
            assert c["resources"]["requests"] and c["resources"]["limits"], f"{ctx}: resources"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), ctx
            assert "memory" in c["resources"]["limits"], ctx


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_services_select_their_pods_and_ports(render, value_set):
    docs = render(value_set)
    pods = [
        (d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet")
    ]
    for svc in find(docs, "Service"):
        selector = svc["spec"]["selector"]
        matching = [spec for labels, spec in pods if selector.items() <= labels.items()]
        assert len(matching) == 1, f"Service {svc['metadata']['name']} selects {len(matching)} pod templates"
        names = {p["name"] for c in matching[0]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (
                f"{svc['metadata']['name']}: no container port {port['targetPort']}"
            )


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workload_selectors_match_templates(render, value_set):
    for d in render(value_set):
        if d["kind"] in ("Deployment", "DaemonSet"):
            assert (
                d["spec"]["selector"]["matchLabels"].items()
                <= d["spec"]["template"]["metadata"]["labels"].items()
            )
    for pdb in find(render(value_set), "PodDisruptionBudget"):
        dep = one(render(value_set), "Deployment")
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_names_fit_kubernetes_limits(render, value_set):
    for d in render(value_set):
        assert len(d["metadata"]["name"]) <= 63, d["metadata"]["name"]


# --- the default install -----------------------------------------------------------------------


def test_default_install_objects(render):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render())
    assert kinds == sorted(
        [
            ("CustomResourceDefinition", "vllmdeployments.vllmfit.dev"),
            ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
            ("ClusterKopfPeering", "vllmfit"),
            ("ServiceAccount", OPERATOR),
            ("ServiceAccount", AGENT),
            ("ClusterRole", OPERATOR),
            ("ClusterRoleBinding", OPERATOR),
            ("Role", OPERATOR),
            ("RoleBinding", OPERATOR),
            ("Role", f"{OPERATOR}-calibration"),
            ("RoleBinding", f"{OPERATOR}-calibration"),
            ("Role", f"{OPERATOR}-reservations"),
            ("RoleBinding", f"{OPERATOR}-reservations"),
            ("ServiceAccount", "vllmfit-reservation"),
            ("Role", "vllmfit-reservation"),
            ("RoleBinding", "vllmfit-reservation"),
            ("PriorityClass", "vllmfit-reservation"),
            ("ClusterRole", AGENT),
            ("ClusterRoleBinding", AGENT),
            ("Deployment", OPERATOR),
            ("PodDisruptionBudget", OPERATOR),
            ("DaemonSet", AGENT),
            ("Service", "vllmfit-webhook"),
            ("Service", "vllmfit-metrics"),
            ("ValidatingWebhookConfiguration", "vllmfit-validate"),
            ("MutatingWebhookConfiguration", "vllmfit-default"),
            ("NetworkPolicy", OPERATOR),
            ("ClusterRole", "vllmfit-edit"),
            ("ClusterRole", "vllmfit-view"),
            ("ValidatingAdmissionPolicy", "vllmfit-gpu-inventory"),
            ("ValidatingAdmissionPolicyBinding", "vllmfit-gpu-inventory"),
            ("ValidatingAdmissionPolicy", "vllmfit-gpu-reservation"),  # issue 21: reservation pods' service account
            ("ValidatingAdmissionPolicyBinding", "vllmfit-gpu-reservation"),
            # helm uninstall's post-delete hook (test_chart_operations.py)
            ("ServiceAccount", "vllmfit-uninstall"),
            ("ClusterRole", "vllmfit-uninstall"),
            ("ClusterRoleBinding", "vllmfit-uninstall"),
            ("Job", "vllmfit-uninstall"),
        ]
    )
    for d in render():
        if d["kind"] not in (
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
            "PriorityClass",
            "ValidatingWebhookConfiguration",
            "MutatingWebhookConfiguration",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ):
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]


def _rules(role):
    return {
        (group, resource, tuple(rule.get("resourceNames", ()))): tuple(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_operator_cluster_role_is_exactly_what_is_used(render):
    rules = _rules(one(render(), "ClusterRole", OPERATOR))
    assert rules == {
        ("vllmfit.dev", "vllmdeployments", ()): ("get", "list", "watch", "patch", "update"),
        ("vllmfit.dev", "vllmdeployments/status", ()): ("get", "patch", "update"),
        ("vllmfit.dev", "vllmdeployments/finalizers", ()): ("update",),
        ("apps", "deployments", ()): ("get", "list", "watch", "create", "patch", "delete"),
        ("", "services", ()): ("get", "list", "watch", "create", "patch", "delete"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets", ()): ("get", "list", "create", "patch", "delete"),
        ("", "pods", ()): ("get", "list", "watch", "patch"),  # patch: lifting the reservation gate
        ("", "pods/log", ()): ("get",),
        ("node.k8s.io", "runtimeclasses", ()): ("get", "list", "watch"),
        ("resource.k8s.io", "resourceslices", ()): ("get", "list", "watch"),
        ("resource.k8s.io", "resourceclaims", ()): ("get", "list", "watch"),
        ("resource.k8s.io", "deviceclasses", ()): ("get", "list", "watch"),
        ("resource.k8s.io", "resourceclaimtemplates", ()): ("get", "list", "watch", "create", "delete"),
        ("", "nodes", ()): ("get", "list", "watch"),
        ("", "configmaps", ()): ("get",),
        ("", "events", ()): ("create", "patch"),
        ("events.k8s.io", "events", ()): ("create", "patch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", ()): ("get", "list", "watch"),
        ("kopf.dev", "clusterkopfpeerings", ()): ("list", "watch"),
        ("kopf.dev", "clusterkopfpeerings", ("vllmfit",)): ("get", "patch"),
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", ("vllmfit-validate",)): (
            "get",
            "patch",
        ),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("vllmfit-default",)): (
            "get",
            "patch",
        ),
    }
    # no access to anybody's Secrets cluster-wide (HF tokens reach vLLM pods as secretKeyRef)
    assert not any(resource == "secrets" for _, resource, _ in rules)


def test_operator_secret_access_is_its_own_certificate_only(render):
    role = one(render(), "Role", OPERATOR)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rules(role) == {
        ("", "secrets", ()): ("create",),
        ("", "secrets", ("vllmfit-webhook-cert",)): ("get", "delete"),
    }
    binding = one(render(), "RoleBinding", OPERATOR)
    assert binding["roleRef"]["name"] == OPERATOR
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": NAMESPACE}]


def test_reservation_pods_are_created_in_the_release_namespace_and_patch_only_pods_there(render):
    assert _rules(one(render(), "Role", f"{OPERATOR}-reservations")) == {("", "pods", ()): ("create", "delete")}
    role = one(render(), "Role", "vllmfit-reservation")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rules(role) == {("", "pods", ()): ("get", "patch")}
    binding = one(render(), "RoleBinding", "vllmfit-reservation")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "vllmfit-reservation", "namespace": NAMESPACE}]
    pc = one(render(), "PriorityClass", "vllmfit-reservation")
    assert (pc["value"], pc["preemptionPolicy"], pc["globalDefault"]) == (1000000, "Never", False)


def test_the_learned_records_configmap_is_the_only_one_the_operator_writes(render):
    role = one(render(), "Role", f"{OPERATOR}-calibration")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rules(role) == {("", "configmaps", ()): ("create",),
                            ("", "configmaps", (defaults.CALIBRATION_CONFIGMAP,)): ("get", "patch")}
    binding = one(render(), "RoleBinding", f"{OPERATOR}-calibration")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": NAMESPACE}]


def test_agent_may_only_read_and_patch_nodes(render):
    assert _rules(one(render(), "ClusterRole", AGENT)) == {("", "nodes", ()): ("get", "patch")}
    binding = one(render(), "ClusterRoleBinding", AGENT)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": AGENT, "namespace": NAMESPACE}]
    ds = one(render(), "DaemonSet", AGENT)
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == AGENT


def test_tenants_and_mps_values_become_operator_flags(render):
    docs = render("default", "--set", "tenants.podSecurityLevel=baseline", "--set", "tenants.allowedHostPaths={/data/models}",
                  "--set", "tenants.allowedCSIDrivers={secrets-store.csi.k8s.io}", "--set", "mps.enabled=true")
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == OPERATOR)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in ("--pod-security-level=baseline", "--allow-host-path=/data/models",
                 "--allow-csi-driver=secrets-store.csi.k8s.io", "--mps-pipe-directory=/tmp/nvidia-mps",
                 "--mps-log-directory=/var/log/nvidia-mps"):
        assert flag in args


def test_operator_container_contract(render):
    dep = one(render(), "Deployment", OPERATOR)
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2
    assert spec["serviceAccountName"] == OPERATOR
    c = _container(render(), "Deployment", OPERATOR, "operator")
    assert c["command"] == ["vllmfit", "operator"]
    assert c["args"] == EXPECTED_OPERATOR_ARGS
    assert c["image"] == "ghcr.io/vllmfit/vllmfit:0.1.0"
    env = _env(c)
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["VLLMFIT_DEFAULT_IMAGE"]["value"] == "vllm/vllm-openai:v0.33.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"webhook": 9443, "http-metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_single_replica_runs_standalone_without_pdb(render):
    c = _container(render("single-replica"), "Deployment", OPERATOR, "operator")
    # no --peering: the operator runs standalone (its default)
    assert c["args"] == [a for a in EXPECTED_OPERATOR_ARGS if not a.startswith("--peering")]
    docs = render("single-replica")
    assert one(docs, "Deployment", OPERATOR)["spec"]["replicas"] == 1
    assert not find(docs, "PodDisruptionBudget") and not find(docs, "ClusterKopfPeering")
    assert not any(r[0] == "kopf.dev" for r in _rules(one(docs, "ClusterRole", OPERATOR)))


def test_replicas_without_peering_fail_even_past_the_schema(helm):
    proc = helm(
        "template",
        "vllmfit",
        str(CHART),
        "--skip-schema-validation",
        "--set",
        "operator.replicas=2",
        "--set",
        "operator.peering.enabled=false",
        check=False,
    )
    assert proc.returncode != 0 and "peering" in proc.stderr


def test_pdb_keeps_one_operator(render):
    pdb = one(render(), "PodDisruptionBudget", OPERATOR)
    assert pdb["spec"]["maxUnavailable"] == 1


def test_peering_object_matches_flag_and_crd(render):
    docs = render()
    peering = one(docs, "ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert (
        f"--peering={peering['metadata']['name']}"
        in _container(docs, "Deployment", OPERATOR, "operator")["args"]
    )
    crd = one(docs, "CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(peering)


def _webhooks(docs):
    vwc = one(docs, "ValidatingWebhookConfiguration", "vllmfit-validate")
    mwc = one(docs, "MutatingWebhookConfiguration", "vllmfit-default")
    return vwc, mwc


def test_webhook_configurations(render):
    vwc, mwc = _webhooks(render())
    (v,) = vwc["webhooks"]
    (m,) = mwc["webhooks"]
    assert v["name"] == "validate.vllmfit.dev" and m["name"] == "default.vllmfit.dev"
    assert v["clientConfig"]["service"]["path"] == "/validate-vllmdeployment"
    assert m["clientConfig"]["service"]["path"] == "/default-vllmdeployment"
    assert v["failurePolicy"] == "Fail" and m["failurePolicy"] == "Fail"
    for hook in (v, m):
        assert hook["clientConfig"]["service"] == {
            **hook["clientConfig"]["service"],
            "name": "vllmfit-webhook",
            "namespace": NAMESPACE,
            "port": 443,
        }
        assert "caBundle" not in hook["clientConfig"], "the operator/cainjector owns caBundle"
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["timeoutSeconds"] == 5
        scale = [  # the validating webhook also reviews kubectl scale / HPA writes to spec.replicas
            {
                "apiGroups": ["vllmfit.dev"],
                "apiVersions": ["v1alpha1"],
                "operations": ["UPDATE"],
                "resources": ["vllmdeployments/scale"],
                "scope": "Namespaced",
            }
        ]
        assert hook["rules"] == [
            {
                "apiGroups": ["vllmfit.dev"],
                "apiVersions": ["v1alpha1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["vllmdeployments"],
                "scope": "Namespaced",
            }
        ] + (scale if hook is v else [])
    assert "annotations" not in vwc["metadata"] and "annotations" not in mwc["metadata"]
    svc = one(render(), "Service", "vllmfit-webhook")
    assert svc["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]


def test_webhook_values(render):
    vwc, mwc = _webhooks(
        render(
            "default",
            "--set",
            "webhook.failurePolicy=Ignore",
            "--set",
            "webhook.timeoutSeconds=10",
            "--set",
            "webhook.mutatingFailurePolicy=Ignore",
        )
    )
    assert vwc["webhooks"][0]["failurePolicy"] == "Ignore" and vwc["webhooks"][0]["timeoutSeconds"] == 10
    assert mwc["webhooks"][0]["failurePolicy"] == "Ignore"


def test_cert_manager_mode(render):
    docs = render("cert-manager")
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert c["args"] == EXPECTED_OPERATOR_ARGS + ["--cert-dir=/etc/vllmfit/certs"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "webhook-cert")
    assert mount == {"name": "webhook-cert", "mountPath": "/etc/vllmfit/certs", "readOnly": True}
    volume = next(
        v
        for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "webhook-cert"
    )
    assert volume["secret"]["secretName"] == "vllmfit-webhook-cert"

    cert = one(docs, "Certificate", "vllmfit-webhook")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert cert["spec"]["secretName"] == "vllmfit-webhook-cert"
    assert f"vllmfit-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = one(docs, "Issuer")
    assert issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    for wc in _webhooks(docs):
        assert (
            wc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/vllmfit-webhook"
        )
    # cert-manager owns the Secret and the caBundle: the operator gets no access to either
    assert not any(_rules(r).get(("", "secrets", ())) for r in find(docs, "Role"))
    assert {r["metadata"]["name"] for r in find(docs, "Role")} == {f"{OPERATOR}-calibration", f"{OPERATOR}-reservations",
                                                                  "vllmfit-reservation"}
    rules = _rules(one(docs, "ClusterRole", OPERATOR))
    assert not any(group == "admissionregistration.k8s.io" for group, _, _ in rules)


CLIENT_CA_FLAG = "--webhook-client-ca=/etc/vllmfit/client-ca/ca.crt"


def _volume(docs, name):
    volumes = one(docs, "Deployment", OPERATOR)["spec"]["template"]["spec"]["volumes"]
    return next((v for v in volumes if v["name"] == name), None)


def test_webhook_client_auth_is_off_by_default_and_renders_nothing(render):
    docs = render()
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert not any(a.startswith(("--webhook-client-ca", "--webhook-client-name")) for a in c["args"])
    assert all(m["name"] != "webhook-client-ca" for m in c["volumeMounts"])
    assert _volume(docs, "webhook-client-ca") is None


def test_webhook_client_auth_from_a_configmap(render):
    docs = render("client-auth")
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert c["args"] == EXPECTED_OPERATOR_ARGS + [
        CLIENT_CA_FLAG,
        "--webhook-client-name=kube-apiserver",
        "--webhook-client-name=kube-apiserver-kubelet-client",
    ]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "webhook-client-ca")
    assert mount == {"name": "webhook-client-ca", "mountPath": "/etc/vllmfit/client-ca", "readOnly": True}
    assert "subPath" not in mount  # a subPath mount would never see the CA change
    assert _volume(docs, "webhook-client-ca") == {
        "name": "webhook-client-ca",
        "configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
    }


def test_webhook_client_auth_from_a_secret_without_names(render):
    docs = render(
        "default",
        "--set",
        "webhook.clientAuth.enabled=true",
        "--set",
        "webhook.clientAuth.caSecret.name=apiserver-client-ca",
        "--set",
        "webhook.clientAuth.caSecret.key=ca.pem",
        "--set-json",
        "webhook.clientAuth.allowedNames=[]",
    )
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert c["args"] == EXPECTED_OPERATOR_ARGS + [CLIENT_CA_FLAG]  # no names: any certificate the CA signed
    assert _volume(docs, "webhook-client-ca") == {
        "name": "webhook-client-ca",
        "secret": {"secretName": "apiserver-client-ca", "items": [{"key": "ca.pem", "path": "ca.crt"}],
                   "defaultMode": 0o440},
    }
    # cert-manager mode and client authentication together
    c = _container(render("cert-manager", "--set", "webhook.clientAuth.enabled=true", "--set",
                          "webhook.clientAuth.caConfigMap.name=ca"), "Deployment", OPERATOR, "operator")
    assert c["args"][-3:] == ["--cert-dir=/etc/vllmfit/certs", CLIENT_CA_FLAG, "--webhook-client-name=kube-apiserver"]


@pytest.mark.parametrize("sources", [[], ["caConfigMap", "caSecret"]])
def test_webhook_client_auth_needs_exactly_one_ca_source(helm, sources):
    args = ["--set", "webhook.clientAuth.enabled=true"]
    for source in sources:
        args += ["--set", f"webhook.clientAuth.{source}.name=ca"]
    proc = helm("template", "vllmfit", str(CHART), *args, check=False)
    assert proc.returncode != 0
    assert "webhook.clientAuth.enabled needs exactly one of webhook.clientAuth.caConfigMap.name" in proc.stderr


@pytest.mark.parametrize("names", ['["kube apiserver"]', '[""]', '["a", "a"]'])
def test_webhook_client_auth_names_are_checked_by_the_schema(helm, names):
    proc = helm("template", "vllmfit", str(CHART), "--set", "webhook.clientAuth.enabled=true", "--set",
                "webhook.clientAuth.caConfigMap.name=ca", "--set-json", f"webhook.clientAuth.allowedNames={names}",
                check=False)
    assert proc.returncode != 0 and "allowedNames" in proc.stderr


def test_cert_manager_with_existing_cluster_issuer(render):
    docs = render("cert-manager-clusterissuer")
    assert not find(docs, "Issuer")
    cert = one(docs, "Certificate")
    assert cert["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert cert["spec"]["duration"] == "2160h"


def test_agent_daemonset(render):
    ds = one(render(), "DaemonSet", AGENT)
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (c,) = spec["containers"]
    assert c["command"] == ["vllmfit", "agent"]
    assert c["args"] == ["--health-port=8082"]
    env = _env(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"health": 8082}
    # it watches GPUs, it must not take one away from vLLM
    assert not any("nvidia.com/gpu" in str(k) for part in c["resources"].values() for k in part)


def test_custom_images_and_names(render):
    docs = render("custom-images")
    dep = one(docs, "Deployment", "gpu-fit-operator")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/ml/vllmfit:0.1.0-rc1" and c["imagePullPolicy"] == "Always"
    assert _env(c)["VLLMFIT_DEFAULT_IMAGE"]["value"] == "registry.example.com/mirror/vllm-openai:v0.33.0"
    assert (
        "--webhook-service=gpu-fit-webhook" in c["args"] and "--cert-secret=gpu-fit-webhook-cert" in c["args"]
    )
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "podAntiAffinity" not in dep["spec"]["template"]["spec"]["affinity"]
    ds = one(docs, "DaemonSet", "gpu-fit-agent")
    assert (
        ds["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example.com/ml/vllmfit-agent:0.1.0-rc1-nvml"
    )
    assert "runtimeClassName" not in ds["spec"]["template"]["spec"]
    # the webhook configurations keep their fixed names but follow the Service
    vwc, _ = _webhooks(docs)
    assert vwc["webhooks"][0]["clientConfig"]["service"]["name"] == "gpu-fit-webhook"


def test_minimal(render):
    kinds = {d["kind"] for d in render("minimal")}
    assert not kinds & {"DaemonSet", "NetworkPolicy", "ServiceMonitor"}
    assert [s["metadata"]["name"] for s in find(render("minimal"), "Service")] == ["vllmfit-webhook"]


def test_metrics_and_service_monitor(render):
    assert not find(render(), "ServiceMonitor")
    docs = render("service-monitor")
    sm = one(docs, "ServiceMonitor", "vllmfit-metrics")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    metrics = one(docs, "Service", "vllmfit-metrics")
    assert endpoint["port"] in {p["name"] for p in metrics["spec"]["ports"]}
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    webhook = one(docs, "Service", "vllmfit-webhook")
    assert not sm["spec"]["selector"]["matchLabels"].items() <= webhook["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert metrics["spec"]["ports"][0]["port"] == 8080


def test_network_policy(render):
    np_ = one(render(), "NetworkPolicy", OPERATOR)
    assert (
        np_["spec"]["podSelector"]["matchLabels"]
        == one(render(), "Deployment")["spec"]["selector"]["matchLabels"]
    )
    webhook_rule, metrics_rule = np_["spec"]["ingress"]
    assert "from" not in webhook_rule and webhook_rule["ports"] == [{"port": 9443, "protocol": "TCP"}]
    assert metrics_rule["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    custom = one(render("service-monitor"), "NetworkPolicy")["spec"]["ingress"][1]["from"][0][
        "namespaceSelector"
    ]
    assert custom["matchExpressions"][0]["values"] == ["monitoring", "observability"]


# --- CRDs ---------------------------------------------------------------------------------------


def test_chart_crds_equal_repository_crds():
    chart_crds = CHART / "crds"
    repo_crds = ROOT / "crds"
    names = sorted(p.name for p in chart_crds.glob("*.yaml"))
    assert (
        names
        == sorted(p.name for p in repo_crds.glob("*.yaml"))
        == ["clusterkopfpeerings.kopf.dev.yaml", "vllmdeployments.vllmfit.dev.yaml"]
    )
    _, mismatch, errors = filecmp.cmpfiles(chart_crds, repo_crds, names, shallow=False)
    assert not mismatch and not errors, (
        f"charts/vllmfit/crds and crds/ differ: {mismatch or errors}; run `make crds`"
    )


def test_rendered_crd_is_the_generated_one(render):
    from vllmfit.cli import crdgen

    crd = one(render(), "CustomResourceDefinition", "vllmdeployments.vllmfit.dev")
    assert crd == crdgen.render_crd()


def test_crd_file_has_one_document():
    text = Path(CHART / "crds" / "vllmdeployments.vllmfit.dev.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert len(docs) == 1 and copy.deepcopy(docs[0])["kind"] == "CustomResourceDefinition"


def test_the_default_kv_grant_reaches_the_operator(render):
    """values.kvCache is the cluster's default KV grant (issue 33): passed as operator flags."""
    docs = render("default", "--set", "kvCache.defaultGrant=room", "--set", "kvCache.defaultRequests=8")
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert "--default-kv-grant=room" in c["args"] and "--default-kv-requests=8" in c["args"]


def test_the_budget_policy_reaches_the_operator(render):
    """values.budget is the cluster-wide budget policy: passed as operator flags."""
    # helm --set types only integers (0.95 would be a string): --set-json, or a values file
    docs = render("default", "--set-json", 'budget={"utilization": 0.95, "reserve": "1Gi"}')
    c = _container(docs, "Deployment", OPERATOR, "operator")
    assert "--budget-utilization=0.95" in c["args"] and "--budget-reserve=1Gi" in c["args"]


def test_the_operator_is_told_its_memory_limit_only_when_it_has_one(render):
    """The downward API gives limits.memory, or the node's allocatable memory where none is set: the
    operator must not size itself against a node."""
    def env(*extra: str) -> dict[str, Any]:
        docs = render("default", *extra)
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == OPERATOR)
        return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    limit = env()["VLLMFIT_MEMORY_LIMIT"]["valueFrom"]["resourceFieldRef"]
    assert (limit["containerName"], limit["resource"]) == ("operator", "limits.memory")
    assert "VLLMFIT_MEMORY_LIMIT" not in env("--set", "operator.resources.limits.memory=null")
