"""Multi-process calibration on CPU (gloo, 2 processes) equals a single-process run; the torchrun CLI path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import calibration_ids, make_model
from transformers import AutoTokenizer

import patchkv
from patchkv.corpus import shakespeare_train
from patchkv.distributed import World, all_reduce_sum, is_main_process, world

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "artifacts" / "reference-llama"
WORLD_SIZE = 2


def _padded_batches():
    """Three batches (odd: rank 0 runs two) of left- and right-padded rows."""
    ids = calibration_ids(6, 20, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[3, 15:] = 0
    mask[4, :2] = 0
    return [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2]} for i in range(0, 6, 2)]


# name: (data, calibrate options); every case's reference is a single-process run on the same data
CASES = {
    "ids_max_tokens": (lambda: calibration_ids(10, 32), dict(mode="post_rope", rank=4, sink_tokens=2, batch_size=2,
                                                            max_tokens=200)),
    "padded_batches": (_padded_batches, dict(mode="pre_rope", energy=0.9, sink_tokens=1)),
    # effect weights with retrieval rows (3: rank 0 measures two) and layer bases
    "text_retrieval_rows": (lambda: "\n\n".join(shakespeare_train())[:12_000],
                            dict(rank=4, seq_len=64, max_tokens=384, sink_tokens=2, fisher_tokens=128, fisher_window=8,
                                 retrieval_rows=3, retrieval_seq=256, layer_bases=True)),
}


def _calibrate_all():
    tokenizer = AutoTokenizer.from_pretrained(REF, local_files_only=True)
    model = make_model("llama", vocab_size=len(tokenizer))
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    out = {}
    for name, (data, options) in CASES.items():
        calls.clear()
        art = patchkv.calibrate(model, data(), tokenizer=tokenizer, progress=False, **options)
        out[name] = {"artifact": art, "forwards": len(calls)}
    handle.remove()
    return out


def _state(art):
    fields = ("mean", "eigenvalues", "eigenvectors", "ranks", "weights", "layer_weights")
    return {f"{kind}.{field}": getattr(getattr(art, kind), field) for kind in ("keys", "values") for field in fields
            if getattr(getattr(art, kind), field) is not None} | {"calibration": art.calibration}


def _errors(rank: int) -> list[str]:
    """Data that is already sharded, or differs between ranks, is refused on every rank (no hang)."""
    from torch.utils.data import DataLoader, DistributedSampler

    model, errors = make_model("llama"), []
    ids = list(calibration_ids(8, 16))
    for data in (DataLoader(ids, batch_size=2, sampler=DistributedSampler(ids)), calibration_ids(4, 16, seed=rank)):
        try:
            patchkv.calibrate(model, data, rank=2, progress=False)
            errors.append("none")
        except (ValueError, patchkv.PatchKVError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    try:
        here = world()
        assert here == World(rank, WORLD_SIZE) and is_main_process() == (rank == 0)
        assert all_reduce_sum(torch.tensor([rank + 1.0], dtype=torch.float64)).item() == 3.0
        results = {name: {"state": _state(r["artifact"]), "forwards": r["forwards"]}
                   for name, r in _calibrate_all().items()}
        results["errors"] = _errors(rank)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # the reference: one process, same thread count, same data
        assert world() == World(0, 1)
        results["single"] = {name: {"state": _state(r["artifact"]), "forwards": r["forwards"]}
                             for name, r in _calibrate_all().items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(spawned, case):
    single = spawned[0]["single"][case]
    ranks = [spawned[r][case] for r in range(WORLD_SIZE)]
    # the work was split: each rank ran only its share of the forward passes
    assert sum(r["forwards"] for r in ranks) == single["forwards"]
    assert all(0 < r["forwards"] < single["forwards"] for r in ranks)
    # every rank returns the same artifact, bit for bit
    for key, value in ranks[0]["state"].items():
        other = ranks[1]["state"][key]
        assert value == other if key == "calibration" else torch.equal(value, other), key
    # which equals the single-process one (eigenvectors under the fixed sign convention)
    mine, ref = ranks[0]["state"], single["state"]
    assert mine["calibration"] == ref["calibration"]
    for key in ref:
        if key == "calibration":
            continue
        atol = 1e-8 if key.endswith("eigenvectors") else 1e-12
        rtol = 1e-9 if key.endswith("weights") else 0  # Fisher sums added in another order
        assert torch.allclose(mine[key].double(), ref[key].double(), rtol=rtol, atol=atol), (key, (mine[key].double()
                                                                                             - ref[key].double()).abs().max())


def test_sharded_or_differing_data_is_refused_on_every_rank(spawned):
    for r in range(WORLD_SIZE):
        sharded, differing = spawned[r]["errors"]
        assert sharded.startswith("ValueError") and "DistributedSampler" in sharded
        assert differing.startswith("PatchKVError") and "different data" in differing


def _torchrun_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("tokens,budgets", [pytest.param(500, "none", id="short"),
                                            pytest.param(1500, "4x,8x,16x", id="full", marks=pytest.mark.slow)])
def test_cli_under_torchrun(tmp_path, tokens, budgets):
    """`torchrun --nproc-per-node 2 -m patchkv calibrate ...`: rank 0 writes the artifact, equal to one process's.
    The short version fits no step scales (two thirds of its time); the full one fits the default budgets'."""
    lines = (ROOT / "patchkv" / "tasks" / "data" / "shakespeare_heldout.jsonl").read_text().splitlines()[:40]
    (tmp_path / "data.txt").write_text("\n".join(json.loads(line)["text"] for line in lines))
    args = ["calibrate", "--model", str(REF), "--data", str(tmp_path / "data.txt"), "--rank", "8",
            "--seq-len", "64", "--max-tokens", str(tokens), "--sink-tokens", "2", "--budgets", budgets]
    torchrun = Path(sys.executable).parent / "torchrun"
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "patchkv", *args,
                          "--out", str(tmp_path / "dist")], env=_torchrun_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("wrote ") == 1  # only rank 0 writes and prints
    single = subprocess.run([sys.executable, "-m", "patchkv", *args, "--out", str(tmp_path / "one")],
                            env=_torchrun_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    a, b = (patchkv.Artifact.load(next((tmp_path / d).glob("*.safetensors"))) for d in ("dist", "one"))
    assert a.calibration == b.calibration and a.calibration["tokens"] == tokens
    for kind in ("keys", "values"):
        x, y = getattr(a, kind), getattr(b, kind)
        assert torch.allclose(x.eigenvalues, y.eigenvalues, rtol=0, atol=1e-12)
        assert torch.allclose(x.mean, y.mean, rtol=0, atol=1e-12)
