"""`vllmfit status`: the live cluster's nodes and VLLMDeployments, read through the official
client, drawn as `vllmfit plan` draws a plan from the operator's status fields (nothing is decided
again); an API server's refusal in words."""

from __future__ import annotations

import argparse
import os
from typing import Any

from vllmfit.cli import output
from vllmfit.cli.documents import Objects
from vllmfit.cli.output import write_then
from vllmfit.cli.plan import build_plan, emit, output_args
from vllmfit.core.errors import UserError, one_line
from vllmfit.core.spec.api import GROUP, KIND, PLURAL, VERSION


def load_live(core: Any, custom: Any) -> Objects:
    """Nodes and VLLMDeployments through the official client (or fakes with the same methods)."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    out = Objects()
    for node in core.list_node().items:
        data = node if isinstance(node, dict) else api.sanitize_for_serialization(node)
        out.nodes.append((f"Node {data.get('metadata', {}).get('name', '?')}", data))
    listing = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    for item in listing.get("items", []):
        meta = item.get("metadata") or {}
        out.deployments.append((f"{KIND} {meta.get('namespace', 'default')}/{meta.get('name', '?')}", item))
    return out


def connect(kubeconfig: str | None, context: str | None) -> tuple[Any, Any]:
    """CoreV1Api and CustomObjectsApi from the kubeconfig (in a pod without one: the service account)."""
    from kubernetes import client, config

    try:
        if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=kubeconfig, context=context)
        else:
            config.load_incluster_config()
    except (config.ConfigException, OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot load the kubeconfig: {one_line(e)}") from None
    return client.CoreV1Api(), client.CustomObjectsApi()


def api_words(e: BaseException) -> str:
    """An API server's refusal as a sentence (the client's own text starts "(404)\nReason: ...")."""
    status = getattr(e, "status", None)
    if not isinstance(status, int):
        return one_line(e)
    if status == 404:
        return (f"{KIND} is not installed in this cluster (no CustomResourceDefinition {PLURAL}.{GROUP}); "
                "install vllmfit with `helm install vllmfit charts/vllmfit`, or its CRDs with "
                "`kubectl apply --server-side -f crds/`")
    if status == 403:
        return f"the API server says this kubeconfig's user may not list Nodes or {KIND}s (403 Forbidden)"
    if status == 401:
        return "the API server did not accept this kubeconfig's credentials (401 Unauthorized)"
    return f"the API server answered {status} {getattr(e, 'reason', '') or ''}".rstrip()


def run_status(args: argparse.Namespace, core: Any = None, custom: Any = None) -> int:
    from kubernetes.client.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    if core is None or custom is None:
        core, custom = connect(args.kubeconfig, args.context)
    try:
        objs = load_live(core, custom)
    except (OpenApiException, HTTPError, OSError, ValueError) as e:  # API errors, no connection
        raise UserError(f"cannot read the cluster: {api_words(e)}") from None
    plan = build_plan(objs, decide=False, hub=True)  # a live command: a model outside the catalog as the operator reads it
    code = write_then(0, lambda: emit(plan, args.output, args.out_file, "vllmfit status"))
    output.errors(plan.errors, "vllmfit status")
    return code


def add_parser(subparsers: Any) -> None:
    s = subparsers.add_parser(
        "status",
        help="show the live cluster's GPU ledger",
        description="Read nodes and VLLMDeployments through the kubeconfig and draw the GPU ledger from "
        "the operator's status fields (nothing is decided again).",
    )
    s.add_argument(
        "--kubeconfig", metavar="FILE", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    s.add_argument("--context", help="kubeconfig context")
    output_args(s)
    s.set_defaults(func=run_status)
