"""The package layering holds: no module imports, even lazily inside a function, one that imports it back."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"patchkv": ROOT / "patchkv", "patchkv.adapters": ROOT / "adapters", "patchkv.kernels": ROOT / "kernels"}


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = [p for p in file.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = (file, file.name == "__init__.py")
    return out


def imports(name: str, file: Path, is_package: bool, known: dict) -> set[str]:
    tree = ast.parse(file.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
                   for n in ast.walk(node)}
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found |= set(subs) or ({target} if target in known else set())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found - {name}


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, file, is_package, known) for name, (file, is_package) in known.items()}

    def reachable(start):
        seen, stack = set(), [start]
        while stack:
            for nxt in graph[stack.pop()] - seen:
                seen.add(nxt)
                stack.append(nxt)
        return seen

    # a package's __init__ re-exports its submodules; a submodule importing its package would be the cycle
    cycles = [(a, b) for a in graph for b in graph[a] if a in reachable(b) and not known[a][1]]
    assert not cycles, cycles


def test_lower_layers_do_not_import_upper_ones():
    known = modules()
    for low in ("patchkv.adapters", "patchkv.kernels", "patchkv.errors", "patchkv.compat", "patchkv.artifact_format",
                "patchkv.pca", "patchkv.quantize"):
        for name, (file, is_package) in known.items():
            if name == low or name.startswith(low + "."):
                assert all(dep.startswith(("patchkv.adapters", "patchkv.kernels", "patchkv.errors", "patchkv.compat",
                                           "patchkv.artifact_format"))
                           for dep in imports(name, file, is_package, known)), name


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_private_names_of_other_libraries_are_read_in_compat_only():
    """A private attribute (`x._name`, or `getattr(x, "_name")`) read outside compat.py is one patchkv defines itself
    (a function, class or attribute it assigns somewhere): transformers', accelerate's, torch's and vLLM's go through
    `patchkv.compat`, where tests/test_compat.py checks each by name."""
    trees = {file: ast.parse(file.read_text()) for file, _ in modules().values()}
    defined, read = set(), []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    defined |= {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(target)
                                if isinstance(n, (ast.Attribute, ast.Name))}
            if file.name == "compat.py":
                continue
            if isinstance(node, ast.Attribute) and _private(node.attr):
                read.append((node.attr, f"{file.relative_to(ROOT)}:{node.lineno}"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                read.append((node.args[1].value, f"{file.relative_to(ROOT)}:{node.lineno}"))
    foreign = [f"{where}: {name}" for name, where in read if name not in defined]
    assert not foreign, foreign
