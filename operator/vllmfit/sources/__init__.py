"""Where model and GPU facts come from: the catalog shipped with vllmfit (`catalog`) and the
Hugging Face Hub (`hub`). Both turn what they read into the core's frozen types."""
