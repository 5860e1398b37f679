"""Placement backends: how a placement decided by the core is held by Kubernetes itself and how a
replica's pod is bound to the GPUs the core chose. The operator builds pods through a backend; the
core never knows which one is in use.

  binding   GPU binding of a replica's container (device-plugin limits for whole nodes,
            NVIDIA_VISIBLE_DEVICES pinning for shared GPUs)
"""
