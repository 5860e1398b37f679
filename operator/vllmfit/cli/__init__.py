"""The `vllmfit` command line (offline and against a live cluster):

  estimate  `vllmfit estimate`, `models`, `gpus`: one deployment on empty GPUs; the catalog
  plan      `vllmfit plan` (from files) and `vllmfit status` (from a cluster)
  render    tables, bars, HTML and SVG pictures of estimates and plans
  crdgen    `vllmfit crd`: the CRD YAML generated from vllmfit.core.spec.api
"""
