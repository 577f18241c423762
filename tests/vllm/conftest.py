"""tests/vllm/: the prefix store inside vLLM (`patchkv.integrations.vllm`), run in .venv-vllm as CI's third stage
(`.venv-vllm/bin/python -m pytest tests/vllm`); the default run leaves this folder out (tests/conftest.py).

vLLM runs in this process (no engine-core process, the uniprocess executor), so a test reaches both sides of the
connector: the scheduler's index and the worker's bytes. One engine serves the module: SmolLM2 at about 1k tokens, in
32-token blocks, vLLM's own prefix cache off (every hit is the store's), one thread (vLLM's OpenMP threads crawl on a
busy 2-core machine), 1 GiB of paged cache."""

import importlib.util
import json
import os
from pathlib import Path

for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1")):
    os.environ.setdefault(name, value)

import pytest  # noqa: E402
import torch  # noqa: E402

if not getattr(importlib.util.find_spec("vllm"), "origin", None):
    raise pytest.UsageError("tests/vllm/ runs in vLLM's environment: bash scripts/setup_vllm.sh, then "
                            ".venv-vllm/bin/python -m pytest tests/vllm")

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
ARTIFACT = ROOT / "artifacts" / "smollm2-bases" / "pre_rope.safetensors"
BLOCK = 32


def documents(domain: str = "prose") -> list[str]:
    lines = (ROOT / "patchkv" / "tasks" / "data" / f"{domain}_4k.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def engine(budget: str, store_bytes: int):
    """An in-process `LLM` on SmolLM2 with the store at `budget`, `store_bytes`, a hit loading every block."""
    from vllm import LLM

    from patchkv.integrations.vllm import kv_transfer_config

    if not SMOLLM2.is_dir():
        pytest.skip(f"{SMOLLM2} is missing: bash scripts/setup.sh writes it")
    torch.set_num_threads(1)
    return LLM(model=str(SMOLLM2), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
               distributed_executor_backend="uni", block_size=BLOCK, max_model_len=2048, seed=0,
               kv_transfer_config=kv_transfer_config(ARTIFACT, budget=budget, store_bytes=store_bytes,
                                                     recompute_tokens=0))
