"""The wheel `pip wheel .` builds carries everything: adapters/ and kernels/ as patchkv.adapters/.kernels, the
methods, the engine integrations, the lm-eval task files as package data; `patchkv eval` runs from it outside the repository."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("run_eval", [pytest.param(False, id="short"),
                                      pytest.param(True, id="full", marks=pytest.mark.slow)])
def test_wheel_contents_and_eval_from_the_installed_wheel(tmp_path, run_eval):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("patchkv-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("patchkv/adapters/llama.py", "patchkv/kernels/ops.py", "patchkv/kernels/latent_cpu.cpp",
                     "patchkv/methods/topk.py", "patchkv/integrations/vllm.py",
                     "patchkv/tasks/__init__.py", "patchkv/tasks/shakespeare_ppl.yaml",
                     "patchkv/tasks/data/shakespeare_heldout.jsonl"):
        assert required in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    # run outside the checkout, with the installed wheel ahead of the editable install on sys.path
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    where = subprocess.run([sys.executable, "-c", "import patchkv.evaluate, patchkv.tasks as t, patchkv.kernels.ops as k; "
                            "print(t.DIR); print(k.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert all(path.startswith(str(site)) for path in where)
    if not run_eval:  # short: the wheel's contents and where it imports from; full: `patchkv eval` from it
        return
    run = subprocess.run([sys.executable, "-m", "patchkv", "eval", "--model", str(ROOT / "artifacts/reference-llama"),
                          "--artifact", str(ROOT / "artifacts/reference-llama-bases/pre_rope.safetensors"),
                          "--tasks", "patchkv_shakespeare_ppl", "--limit", "1", "--chunk", "32"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "unpatched" in run.stdout and "pre_rope" in run.stdout
