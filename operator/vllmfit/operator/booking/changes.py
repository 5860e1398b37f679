"""Which spec changes need a new fit check: one rule the webhook and the operator's decide both apply
(issue 29: no module outside the admission room imports the webhook)."""

from __future__ import annotations

from vllmfit.core.placement import affinity
from vllmfit.core.spec import api

NOT_MEMORY = frozenset({"env", "resources", "hf_token_secret_ref", "extra_args"})

def memory_changes(old: api.VLLMDeploymentSpec, new: api.VLLMDeploymentSpec) -> list[str]:
    """Fields whose change needs a new fit check (everything but env, resources, secrets, args,
    and a podTemplate change that leaves its required node affinity as it was)."""
    return [n for n in type(new).model_fields if n not in NOT_MEMORY and getattr(old, n) != getattr(new, n)
            and not (n == "pod_template" and _node_terms(old) == _node_terms(new))]


def _node_terms(spec: api.VLLMDeploymentSpec) -> object:
    try:
        return affinity.required_terms(spec)
    except ValueError as e:
        return str(e)
