"""patchkv's hot-path kernels: `ops` (dispatch), `reference` (PyTorch, the CPU path and oracle), `triton_kernels`.

Installed as `patchkv.kernels`, this file does nothing. Run from the repository root, the folder is also importable
as a top-level `kernels`: the name of Hugging Face's hub-kernels package, which `transformers` probes at start-up
and, from 5.25, imports. Imported under that name, it hands the name over to the real package when one is installed
(found on the path without the repository root), and otherwise stays an empty package without a version, which
`transformers` correctly takes as "not installed".
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real  # what `import kernels` returns from here on
        _spec.loader.exec_module(_real)
