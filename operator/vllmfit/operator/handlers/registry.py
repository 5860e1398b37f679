"""Every Kopf registration of the operator, in one table: what it watches, the handler id (Kopf
keeps each handler's progress under its id, so ids never change), and the module that handles it.

The handling lives in one module per watched kind (`vllmdeployments`, `nodes`, `replica_pods`,
`reservation_pods`, `dra_objects`) plus `startup` (start-up, resync, login, clean-up); they share
`common` (Effects, Events, parsing), `decide` (decisions -> records, under the lock), `children`
(Deployments, Services, claim templates), `writes` (finish: the crash-safe order of writes, and
place: reservations and gates) and `sweep`. A new watch is one line here and a function there.
`counted` counts each handler's exceptions in vllmfit_reconcile_errors_total{handler}.
"""

from __future__ import annotations

import kopf

from vllmfit.backends import reservation as rsv
from vllmfit.operator.handlers import (
    dra_objects,
    nodes,
    replica_pods,
    reservation_pods,
    runtimeclasses,
    startup,
    vllmdeployments,
)
from vllmfit.operator.handlers.common import RESOURCE
from vllmfit.operator.metrics import counted
from vllmfit.operator.rendering import builders

OURS = {builders.MANAGED_BY: "vllmfit"}
REPLICA_PODS = {builders.LABEL_DEPLOYMENT: kopf.PRESENT, **OURS}
RESERVATION_PODS = {rsv.ROLE_LABEL: rsv.ROLE, **OURS}

# start-up, login, clean-up
kopf.on.startup(id="rebuild")(startup.startup)
kopf.on.login(id="login")(startup.login)
kopf.on.cleanup(id="cleanup")(startup.cleanup)

# VLLMDeployment
kopf.on.event(*RESOURCE, id="adopt")(counted("adopt", vllmdeployments.on_event))  # queues it: reconcile
kopf.on.delete(*RESOURCE, id="release")(counted("release", vllmdeployments.on_delete))

# Nodes
kopf.on.event("", "v1", "nodes", id="nodes")(counted("nodes", nodes.on_node))
kopf.on.event("", "v1", "nodes", id="startup-drains")(counted("startup-drains", startup.settle_startup_drains))

# Pods of vLLM replicas (health and logs; the reservation gate and claim allocation). The index
# keeps nothing: no handler runs before the pods watch has listed (startup.settle_startup_drains)
kopf.on.index("", "v1", "pods", id="pods-listed", labels=REPLICA_PODS)(startup.pods_listed)
kopf.on.event("", "v1", "pods", id="pods", labels=REPLICA_PODS)(counted("pods", replica_pods.on_pod))
kopf.on.event("", "v1", "pods", id="gates", labels=REPLICA_PODS)(counted("gates", replica_pods.on_gated_pod))

# Reservation pods (device-plugin nodes)
kopf.on.event("", "v1", "pods", id="reservations", labels=RESERVATION_PODS)(
    counted("reservations", reservation_pods.on_reservation))

# DRA objects
kopf.on.event("resource.k8s.io", "v1", "resourceslices", id="slices")(counted("slices", dra_objects.on_slice))
kopf.on.event("resource.k8s.io", "v1", "resourceclaims", id="claims")(counted("claims", dra_objects.on_claim))

# RuntimeClasses (the runtime class of replicas that share a GPU must exist)
kopf.on.event("node.k8s.io", "v1", "runtimeclasses", id="runtimeclasses")(
    counted("runtimeclasses", runtimeclasses.on_runtimeclass))
