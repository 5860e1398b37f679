"""`vllmfit operator`: run the operator against the in-cluster config or the current kubeconfig.

Equivalent to `kopf run --all-namespaces --standalone -m vllmfit.operator` plus the metrics
server, the liveness endpoint and the admission webhook (when vllmfit.operator.admission.webhook is there).
Kopf and the Kubernetes client are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
from typing import Any

from vllmfit import __version__
from vllmfit.backends.dra import NVIDIA_DRIVER
from vllmfit.core import choices, defaults, memory
from vllmfit.core.errors import UserError
from vllmfit.core.spec import api


def peering_priority(name: str) -> int:
    """A stable priority from the pod's name (POD_NAME). Kopf pauses every operator while a live
    peer has a higher priority, and peers with equal priorities all pause: replicas need distinct
    ones, so the highest-named replica is the active one and the others are warm standbys."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 1_000_000_000 + 1


def _webhook() -> Any:
    try:
        from vllmfit.operator.admission import webhook
    except ImportError:
        return None
    return webhook


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "operator",
        help="Run the Kubernetes operator (admits VLLMDeployments onto shared GPUs).",
        description="Watch VLLMDeployments, Nodes and vLLM pods in all namespaces; admit, place and serve.",
    )
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="namespace the operator runs in (its Secret, its Events for cluster objects); "
                        "default: $POD_NAMESPACE")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port, 0 = off (default 8080)")
    p.add_argument("--health-port", type=int, default=8081, help="Kopf liveness /healthz port, 0 = off (default 8081)")
    p.add_argument("--peering", metavar="NAME", default=None,
                   help="ClusterKopfPeering for several replicas: one is active, the others stand by "
                        "(priority from $POD_NAME); default: standalone")
    p.add_argument("--default-image", default=os.environ.get("VLLMFIT_DEFAULT_IMAGE") or defaults.DEFAULT_IMAGE,
                   help="vLLM image for specs that name none (default: $VLLMFIT_DEFAULT_IMAGE or %(default)s)")
    p.add_argument("--resync-seconds", type=float,
                   default=_env_float("VLLMFIT_RESYNC_SECONDS", defaults.RESYNC_SECONDS),
                   help="rebuild the ledger from the API this often when idle, so a standby peer is current "
                        "when it takes over (less often where a resync would take over a tenth of a core); "
                        "0 = never (default: $VLLMFIT_RESYNC_SECONDS or %(default)g)")
    p.add_argument("--placement-backend", choices=("auto", "dra", "device-plugin"),
                   default=os.environ.get("VLLMFIT_PLACEMENT_BACKEND") or "auto",
                   help="how Kubernetes holds the GPUs vllmfit books: auto = DRA on nodes whose GPUs a "
                        "ResourceSlice publishes with shareable memory, reservation pods elsewhere "
                        "(docs/placement-backends.md; default: $VLLMFIT_PLACEMENT_BACKEND or auto)")
    p.add_argument("--reservation-image", default=os.environ.get("VLLMFIT_RESERVATION_IMAGE") or "",
                   help="image of GPU reservation pods; it must run `vllmfit reserve` "
                        "(default: $VLLMFIT_RESERVATION_IMAGE, else the vllmfit image of this version)")
    p.add_argument("--reservation-priority-class", default=os.environ.get("VLLMFIT_RESERVATION_PRIORITY_CLASS") or "",
                   help="priorityClassName of reservation pods (default: $VLLMFIT_RESERVATION_PRIORITY_CLASS)")
    p.add_argument("--reservation-runtime-class", default=os.environ.get("VLLMFIT_RESERVATION_RUNTIME_CLASS", "nvidia"),
                   help="runtimeClassName of reservation pods, empty for none (default: nvidia)")
    p.add_argument("--reservation-service-account", default=os.environ.get("VLLMFIT_RESERVATION_SERVICE_ACCOUNT") or "",
                   help="service account of reservation pods: it may get and patch pods in the operator's "
                        "namespace (the pod writes its GPU's UUID on itself)")
    p.add_argument("--reservation-image-pull-secret", action="append", default=[], metavar="NAME",
                   help="a Secret in the operator's namespace that reservation pods pull their image with "
                        "(repeatable)")
    p.add_argument("--dra-driver", default=os.environ.get("VLLMFIT_DRA_DRIVER") or NVIDIA_DRIVER,
                   help=f"DRA driver whose ResourceSlices publish the GPUs (default: {NVIDIA_DRIVER})")
    p.add_argument("--dra-device-class", default=os.environ.get("VLLMFIT_DRA_DEVICE_CLASS") or NVIDIA_DRIVER,
                   help=f"DeviceClass the replicas' claims ask for (default: {NVIDIA_DRIVER})")
    p.add_argument("--budget-utilization", type=float, metavar="U",
                   default=_env_float("VLLMFIT_BUDGET_UTILIZATION", defaults.UTILIZATION),
                   help="cluster-wide budget policy: fraction of each GPU vllmfit hands out, in [0, 1]; node "
                        f"label {defaults.BUDGET_UTILIZATION_LABEL} overrides it per node pool "
                        "(default: $VLLMFIT_BUDGET_UTILIZATION or %(default)s)")
    p.add_argument("--budget-reserve", metavar="QTY",
                   default=os.environ.get("VLLMFIT_BUDGET_RESERVE") or str(defaults.COUNTED_RESERVE_BYTES),
                   help="cluster-wide budget policy: bytes held back on each GPU besides (1 - utilization), a "
                        f"Kubernetes quantity; node label {defaults.BUDGET_RESERVE_LABEL} overrides it (default: "
                        "$VLLMFIT_BUDGET_RESERVE or %(default)s, the counted policy; 2Gi is ADR-0002's)")
    choices.add_kv_grant_arguments(p, os.environ)  # the CLI's estimate and plan take the same flags
    g = choices.add_tenancy_arguments(p, os.environ)
    g.add_argument("--mps-pipe-directory", default=os.environ.get("VLLMFIT_MPS_PIPE_DIRECTORY") or "", metavar="DIR",
                   help="turn the MPS memory-limit binding on: sharing replicas get CUDA_MPS_PINNED_DEVICE_MEM_LIMIT "
                        "for their booked bytes and mount the MPS control daemon's pipe directory DIR from the host "
                        "(docs/placement-backends.md, \"Enforcement\"; default off)")
    g.add_argument("--mps-log-directory", default=os.environ.get("VLLMFIT_MPS_LOG_DIRECTORY")
                   or defaults.MPS_LOG_DIRECTORY, metavar="DIR",
                   help="with --mps-pipe-directory: the daemon's log directory (default %(default)s)")
    p.add_argument("--memory-limit", metavar="QTY", default=os.environ.get("VLLMFIT_MEMORY_LIMIT") or "",
                   help="the operator's own memory limit, a Kubernetes quantity (the chart passes its container's "
                        "limits.memory): at start-up it says in its log and an Event, and at every scrape in the "
                        "vllmfit_operator_memory_* metrics, when the cluster it holds needs more (docs/install.md, "
                        "\"Sizing the operator\"; default: $VLLMFIT_MEMORY_LIMIT, none)")
    p.add_argument("--verbose", action="store_true", help="log Kopf's debug messages")
    p.add_argument("--release-finalizers", action="store_true",
                   help="do not run: remove vllmfit's finalizer from every VLLMDeployment and exit, so none is "
                        "left stuck once the operator is gone (the chart's post-delete hook; docs/operations.md)")
    p.add_argument("--settle-seconds", type=float, default=5.0, metavar="S",
                   help="with --release-finalizers: done once a pass S seconds after the last removal finds "
                        "nothing (an operator still stopping may add the finalizer back) (default 5)")
    hook = _webhook()
    if hook is not None:
        hook.add_arguments(p)
    p.set_defaults(func=run)


def tenancy(args: argparse.Namespace) -> tuple[Any, Any]:
    """(validate.Policy, binding.Mps or None) from the flags."""
    from vllmfit.backends import binding

    policy = choices.tenancy_from_args(args)
    mps = binding.Mps(args.mps_pipe_directory, args.mps_log_directory) if args.mps_pipe_directory else None
    return policy, mps


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return float("nan")  # refused by budget_policy with the value named


def budget_policy(args: argparse.Namespace) -> memory.BudgetPolicy:
    """--budget-utilization / --budget-reserve as the cluster-wide policy; UserError (one line, exit 2)
    when outside [0, 1] or not a quantity. Checked before Kopf starts."""
    from vllmfit.core.quantity import parse_bytes

    try:
        reserve = parse_bytes(args.budget_reserve, "--budget-reserve")
    except ValueError as e:
        raise UserError(str(e)) from None
    policy = memory.BudgetPolicy(args.budget_utilization, reserve, "cluster")
    bad = policy.error()
    if bad:
        raise UserError(bad.replace("budget utilization", "--budget-utilization").replace("budget reserve",
                                                                                          "--budget-reserve"))
    return policy


FINALIZER = api.FINALIZER
RELEASE_TIMEOUT_S = 300.0


def release_finalizers(custom: Any, settle: float, *, timeout: float = RELEASE_TIMEOUT_S,
                       say: Any = print, sleep: Any = None) -> int:
    """Remove FINALIZER from every VLLMDeployment (a JSON Patch that tests the entry it removes,
    so another controller's finalizer is never touched), again until a pass `settle` seconds
    after the last removal finds none. Returns how many were removed; raises UserError past
    `timeout` (an operator that keeps adding it back is still running)."""
    import time

    from vllmfit.core.spec import api

    sleep = sleep or time.sleep
    removed, quiet_since, deadline = 0, time.monotonic(), time.monotonic() + timeout
    while True:
        found = 0
        listed = custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)
        for obj in listed.get("items") or []:
            meta = obj.get("metadata") or {}
            finalizers = list(meta.get("finalizers") or [])
            if FINALIZER not in finalizers:
                continue
            i = finalizers.index(FINALIZER)
            patch = [{"op": "test", "path": f"/metadata/finalizers/{i}", "value": FINALIZER},
                     {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
            try:
                custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, meta.get("namespace") or "default",
                                                      api.PLURAL, meta.get("name"), patch,
                                                      _content_type="application/json-patch+json")
            except Exception as e:  # kubernetes.client.ApiException: gone (404) or changed (409, 422): look again
                if getattr(e, "status", None) not in (404, 409, 422):
                    raise
                found += 1
                continue
            found += 1
            removed += 1
            say(f"released {meta.get('namespace')}/{meta.get('name')}")
        now = time.monotonic()
        if found:
            quiet_since = now
        elif now - quiet_since >= settle:
            return removed
        if now > deadline:
            raise UserError(f"the finalizer {FINALIZER} keeps coming back after {timeout:.0f} s: a vllmfit "
                            "operator is still running (scale it to 0 first)")
        sleep(min(1.0, max(settle, 0.05)))


def run_release(args: argparse.Namespace) -> int:
    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:  # $KUBECONFIG read now (the client reads it once, at import)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    except (config.ConfigException, OSError) as e:
        raise UserError(f"cannot reach the API server: {e}") from None
    with client.ApiClient() as api_client:
        api_client.user_agent = f"vllmfit/{__version__}"
        n = release_finalizers(client.CustomObjectsApi(api_client), args.settle_seconds)
    print(f"{n} VLLMDeployment finalizer(s) released; none left")
    return 0


def options_from_args(args: argparse.Namespace) -> Any:
    """The operator's settings (state.Options), read once from its flags, whose defaults come
    from the environment and core.defaults (add_parser): the one place they are read."""
    from vllmfit.backends import reservation as rsv
    from vllmfit.operator.booking.state import Options

    policy, mps = tenancy(args)
    return Options(
        namespace=args.namespace, default_image=args.default_image, resync_seconds=args.resync_seconds,
        placement_backend=args.placement_backend, dra_driver=args.dra_driver, dra_device_class=args.dra_device_class,
        budget=budget_policy(args), kv_grant=choices.kv_grant_from_args(args),
        tenancy=policy, mps=mps, memory_limit_bytes=memory_limit(args), pod_name=os.environ.get("POD_NAME"),
        reservation=rsv.Config(
            namespace=args.namespace or "default", image=args.reservation_image or rsv.Config().image,
            priority_class=args.reservation_priority_class, runtime_class=args.reservation_runtime_class,
            service_account=args.reservation_service_account,
            image_pull_secrets=tuple(getattr(args, "reservation_image_pull_secret", None) or ())))


def memory_limit(args: argparse.Namespace) -> int | None:
    """--memory-limit in bytes (None: no limit given); UserError (one line, exit 2) when it is not
    a quantity. Checked before Kopf starts."""
    from vllmfit.core.quantity import parse_bytes

    value = getattr(args, "memory_limit", "")
    if not value:
        return None
    try:
        return parse_bytes(value, "--memory-limit") or None
    except ValueError as e:
        raise UserError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    import asyncio

    if args.release_finalizers:
        return run_release(args)

    import kopf

    from vllmfit.operator import handlers, metrics
    from vllmfit.operator.booking.state import Store

    options = options_from_args(args)  # before anything starts: a bad policy is one line and exit code 2
    kopf.configure(verbose=args.verbose)
    # The operator's state, built once and passed in: to every Kopf handler through the memo
    # (handlers.common.store_of), to the webhook through setup, to the metrics at start-up.
    store = Store(options)
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    hook = _webhook()
    if hook is not None:
        hook.setup(settings, args, store, observer=metrics.observe_review)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    # Kopf stops on SIGINT/SIGTERM by itself (it installs the signal handlers) and returns.
    priority = peering_priority(os.environ.get("POD_NAME") or socket.gethostname()) if args.peering else None
    asyncio.run(kopf.operator(settings=settings, clusterwide=True, standalone=args.peering is None,
                              peering_name=args.peering, priority=priority, liveness_endpoint=liveness,
                              memo=kopf.Memo(store=store)))
    return 0
