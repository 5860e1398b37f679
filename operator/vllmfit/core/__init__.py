"""The pure core: every decision vllmfit makes, as data. No I/O, no Kubernetes, Kopf, NVML or HTTP
library (import-linter checks it). The shells (CLI, operator, agent, placement backends) call
these same functions, so they never disagree.

  defaults    every default, named once
  errors      bad-input errors every layer may raise
  api         the VLLMDeployment spec/status and node-inventory types (pydantic); crds/ comes from them
  modelarch   model and GPU facts as frozen types; Hugging Face config.json -> ModelArch
  memory/     what one deployment needs on each GPU (weights, KV, activation, overhead, versions)
  placement/  the per-GPU ledger, the search, reasons, fixes, re-planning, the plan JSON contract
  observe     attribution of the agent's measured GPU use to deployments and foreign processes
"""
