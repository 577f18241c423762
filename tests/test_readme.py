"""The README's example runs as written (paths pointed at this checkout and a temporary folder)."""

import re
from pathlib import Path

from patchkv.corpus import corpus_dir

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    for block in blocks:  # every snippet at least parses
        compile(block, "README.md", "exec")
    code = next(block for block in blocks if "artifacts/reference-llama" in block)  # the one that runs as written
    assert len(code.strip().splitlines()) <= 12
    code = (code.replace("../shared/corpus", str(corpus_dir()))
                .replace('"artifacts/', f'"{ROOT}/artifacts/')
                .replace('"bases/"', f'"{tmp_path}/bases/"'))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.startswith("HAMLET.") and len(printed) > 40
    model = namespace["model"]
    assert not any(hasattr(m, "patchkv") for m in model.modules())  # removed at the end
    assert (tmp_path / "bases" / "patchkv.safetensors").is_file()
