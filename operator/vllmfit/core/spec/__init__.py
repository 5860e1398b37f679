"""The VLLMDeployment API as users write it, and what the operator writes back.

  base       the base of every API model (camelCase, unknown fields refused, frozen)
  names      Hugging Face repo ids and Kubernetes names, checked before use
  extraargs  `spec.extraArgs` read the way `vllm serve`'s argparse reads them
  parts      the spec's parts: key refs, placement, pod template, KV request, LoRA
  status     the status: phase, conditions, placement, per-GPU memory and headroom
  api        the VLLMDeployment spec and object (re-exports parts and status); crds/ comes from here

Imports only the ground floor of the core (defaults, limits, errors, quantity)."""
