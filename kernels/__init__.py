"""patchkv's hot-path kernels: `ops` (dispatch), `reference` (PyTorch, the CPU path and oracle), `triton_kernels`.

This file imports nothing on purpose. Run from the repository root, this folder is also importable as a
top-level `kernels`, the name of Hugging Face's hub-kernels package, which `transformers` probes (and
imports) at start-up; an empty package without a version is then correctly taken as "not installed".
"""
