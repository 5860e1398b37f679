"""The pure core: every decision vllmfit makes, as data. No I/O, no Kubernetes, Kopf, NVML or HTTP
library (import-linter checks it). The shells (CLI, operator, agent, placement backends) call
these same functions, so they never disagree.

  defaults     every default, named once
  limits       every physical bound on outside input, named once
  errors       bad-input errors every layer may raise
  quantity     Kubernetes quantities (`20Gi`) as integer bytes
  names        Hugging Face repo ids and Kubernetes names, checked before use
  extraargs    `spec.extraArgs` read the way `vllm serve`'s argparse reads them
  apimodel     the base of the API models (camelCase, unknown fields refused, frozen)
  status       the VLLMDeployment status types
  api          the VLLMDeployment spec and object (pydantic; re-exports status); crds/ comes from them
  inventory    the node agent's inventory annotation types
  hfconfig     a config.json read as transformers/vLLM read it (nesting, class defaults, max length)
  statespace   hybrid models: layer roles, recurrent-state shapes, mixer parameters
  modelarch    model and GPU facts as frozen types
  modelconfig  Hugging Face config.json -> ModelArch
  memory/      what one deployment needs on each GPU (weights, KV, activation, overhead, versions)
  placement/   the per-GPU ledger, the search, reasons, fixes, re-planning, the plan JSON contract
  observe      attribution of the agent's measured GPU use to deployments and foreign processes
"""
