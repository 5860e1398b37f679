"""The model facts: what a model is, read from its config.json the way transformers and vLLM read it.

  hfconfig  a config.json read as transformers/vLLM read it (nesting, class defaults, max length)
  hybrid    hybrid models: layer roles, recurrent-state shapes, mixer parameters
  facts     `ModelArch`, `Quant`, `GpuType`: model and GPU facts as frozen types; the TP check
  config    a config.json -> `ModelArch` (every count bounded); safetensors index totals

Imports only the ground floor of the core (defaults, limits, errors, quantity)."""
