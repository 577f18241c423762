"""What every benchmark shares: the reference models, the named configurations (registry), perplexity rows, result
files and their provenance.

    from evals.suite import CONFIGS, load_smollm2
    model, tokenizer = load_smollm2()
    patch = CONFIGS["8x"].patch(artifacts, context=4096)   # (artifact, methods) or None for a cache config

A configuration (`patchkv.configs`, which `patchkv report` builds its own from too) is methods + artifact + budget:
`patchkv` configs compress the cache at a ratio against the bf16
cache, every byte counted (codes, the exact sinks and window, the int32 positions) at the context they run at;
`QuantizedCache` configs are transformers' own quantized cache. Every result file a benchmark writes has a
provenance sidecar (`<file>.provenance.json`: commit, command, machine, threads, versions, date, `models_dtype`).

The reference models load in bfloat16, or in the dtype `PATCHKV_EVALS_DTYPE` names (`float32`): on a CPU without
native bf16 arithmetic (AVX2 only) torch's bf16 runs 6x (a SmolLM2 forward) to 90x (a plain matmul) slower than
float32 (README, quick start), so the test suite's real-model checks set it (tests/conftest.py). Figures in
evals/results are bfloat16 unless their provenance says otherwise.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from functools import cache
from pathlib import Path

import torch

import patchkv
from patchkv.budgets import EXACT, Budget, sixteen_bit_bytes
from patchkv.configs import Config, budget, peer, quantized_cache, unpatched
from patchkv.nbytes import cache_nbytes
from patchkv.perplexity import token_nll
from patchkv.provenance import provenance
from patchkv.records import write_csv as write_rows

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
BASES = ROOT / "artifacts" / "smollm2-bases"
GEMMA3 = ROOT / ".models" / "gemma-3-270m"
GEMMA3_BASES = ROOT / "artifacts" / "gemma3-bases"
RESULTS = ROOT / "evals" / "results"
DTYPES = ("bfloat16", "float32")


def models_dtype() -> torch.dtype:
    """The dtype the reference models and their bases load in: `PATCHKV_EVALS_DTYPE` (bfloat16 or float32), else
    bfloat16."""
    name = os.environ.get("PATCHKV_EVALS_DTYPE", "bfloat16")
    if name not in DTYPES:
        raise SystemExit(f"PATCHKV_EVALS_DTYPE={name!r}: expected one of {', '.join(DTYPES)}; unset it for bfloat16")
    return getattr(torch, name)


def load_smollm2(dtype: torch.dtype | None = None, attn: str = "sdpa", rope_factor: float = 1.0):
    """(model, tokenizer): SmolLM2-135M-Instruct from the folder `scripts/setup.sh` writes, in eval mode, in `dtype`
    (default `models_dtype()`). rope_factor > 1: its RoPE scaled linearly by that factor (positions past its trained
    8k)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(SMOLLM2)
    if rope_factor > 1:
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": rope_factor}
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, config=config, dtype=dtype or models_dtype(),
                                                 attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(SMOLLM2)


#: the spans of the "-spanS" configs' bases across layers (artifact format version 7): the shipped pre-RoPE artifact
#: with its layer bases calibrated across S layers (`span_artifact`)
SPANS = (5, 15)
#: where `span_artifact` keeps them (not committed: 47 MB at 5 layers, 136 MB at 15)
SPAN_BASES = ROOT / ".cache" / "spans"


def _coded(ratio: float, name: str, note: str, mode: str = "pre_rope", basis: str = "head", salience=None,
           extra: tuple = (), family: str = "patchkv", near=None, regions=None, evict=None) -> Config:
    return budget(Budget(ratio=ratio, pool="global", basis=basis, salience=salience, near=near, regions=regions,
                         evict=evict), name, mode=mode, extra=extra, family=family, note=note)


#: the salient fraction the suite's salience configs keep exact per KV head (paid for from the same budget)
SALIENT_FRACTION = 1 / 128
#: the fraction kept as int8 copies ("-int8" configs): twice the tokens, for about the bytes of SALIENT_FRACTION exact
INT8_FRACTION = 1 / 64
#: near codes at 4 times the middle's bits ("near4" configs): the knee of 2 to 8 times on calibration text at 16x
#: (`python -m evals near-tokens --tokens 960 --factors 3,4,5,6,8 --name near_factors`)
NEAR4 = patchkv.NearCodes(factor=4)
#: 32x's near codes at 6 times the middle's bits with half the int8 copies ("32x-layer-near6-novelty128-int8-w8"): at
#: 32x the step from 4 to 6 times and from 1/64 to 1/128 copies each pays on held-out prose (scratch sweep, README)
NEAR6 = patchkv.NearCodes(factor=6)
NEAR6_INT8_FRACTION = 1 / 128
#: ... or the usual fraction as int4 copies ("32x-layer-near6-novelty-int4-w8"): as many needles kept as the 1/64 int8
#: copies, for the bytes of the 1/128 (scratch runs on held-out prose and RULER samples 0-29, README)
INT4_COPIES = patchkv.Novelty(INT8_FRACTION, bits=4)
#: the exact regions of the "-w8" configs: the budgets' sinks and window, the window held as int8 (half its bytes go
#: to the codes)
INT8_WINDOW = patchkv.SinksWindow(*EXACT, bits=8)


#: the share 32x drops ("32x-evict70"): at 32x the codes of every token get 23 bits per head, too few for a needle;
#: dropping 70% gives the rest 76 (scratch runs on RULER samples 0-4, float32: 0.5 found 2, 0.7 and 0.85 all 5)
EVICT32_FRACTION = 0.7


def _evicting(ratio: int, fraction: float = 0.3, scorer: str = "novelty") -> Config:
    """`ratio` with `Evict(fraction, scorer)` from the same bytes: "16x-evict" (Novelty), another fraction named by
    its percentage ("16x-evict20"), another scorer by its name after it ("16x-evict-attentionmass")."""
    method = patchkv.Evict(fraction, scorer)
    share = "" if fraction == patchkv.Evict().fraction else str(round(100 * fraction))
    by = "" if scorer == patchkv.Evict().scorer else f"-{scorer.replace('_', '')}"
    return _coded(ratio, f"{ratio}x-evict{share}{by}",
                  f"global pre-RoPE codes, {method.spec()} dropped, {ratio}x vs bf16", evict=method,
                  family=f"patchkv+evict{share}{by.replace('-', '+')}")


def _salient(ratio: int, scorer: type) -> Config:
    method = scorer(SALIENT_FRACTION)
    return _coded(ratio, f"{ratio}x-{method.name.replace('_', '')}",
                  f"global pre-RoPE codes + {method.spec()} exact, {ratio}x vs bf16", salience=method,
                  family=f"patchkv+{method.name}")


def _near(ratio: int, basis: str = "head", salience=None, regions=None, near=patchkv.NearCodes()) -> Config:
    """`ratio` with near codes from the same bytes, on per-head or layer bases, and a salience method's copies beside
    them: "16x-near", "16x-layer-near", "16x-near-novelty", "16x-layer-near-novelty", with int8 copies
    "16x-near-novelty-int8" (int4 "-int4"), with `regions` `INT8_WINDOW` (an int8 window) "-w8" after the name, and
    with near codes at 4 times the middle's bits (`NEAR4`) "near4" in place of "near"; a salience fraction other than
    the usual one for its copies is named by its inverse ("novelty128-int8": 1/128 as int8 copies; int8 and int4
    copies' usual fraction is `INT8_FRACTION`)."""
    layer = "-layer" if basis == "layer" else ""
    factor = "" if near.factor == patchkv.NearCodes().factor else str(near.factor)
    usual = INT8_FRACTION if salience is not None and salience.bits != 16 else SALIENT_FRACTION
    share = "" if salience is None or salience.fraction == usual else str(round(1 / salience.fraction))
    kept = f"-{salience.name}{share}{f'-int{salience.bits}' if salience.bits != 16 else ''}" if salience else ""
    window = "-w8" if regions is not None else ""
    note = (f"global pre-RoPE codes{' on layer bases' if layer else ''} + {near.spec()}"
            f"{f' + {salience.spec()} kept' if salience else ''}{' + int8 window' if window else ''}, {ratio}x vs bf16")
    return _coded(ratio, f"{ratio}x{layer}-near{factor}{kept}{window}", note, basis=basis, salience=salience,
                  near=near, regions=regions,
                  family=f"patchkv{layer}+near{factor}{kept.replace('-', '+')}{window.replace('-', '+')}")


CONFIGS: dict[str, Config] = {c.name: c for c in (
    unpatched(),
    quantized_cache(4, name="quanto-int4"),
    *(_coded(ratio, f"{ratio}x", f"global pre-RoPE codes, {ratio}x vs bf16") for ratio in (4, 8, 16, 32)),
    *(_coded(ratio, f"{ratio}x-layer", f"global pre-RoPE codes on layer bases, {ratio}x vs bf16", basis="layer",
             family="patchkv-layer") for ratio in (8, 16, 32)),
    *(_coded(ratio, f"{ratio}x-span{span}", f"global pre-RoPE codes on bases across {span} layers, {ratio}x vs bf16",
             mode=f"pre_rope-span{span}", basis="layer", family=f"patchkv-span{span}")
      for span in SPANS for ratio in (8, 16, 32)),
    # rotated keys share a basis across layers badly: +22.7% / +18.5% on the first two prose documents, worse than
    # plain 16x, for decode at 1.8x plain 16x's at 8k where pre-RoPE spans take 3.3x (throughput_post_spans.csv)
    _coded(16, "16x-post-span5", "global post-RoPE codes on bases across 5 layers, 16x vs bf16",
           mode="post_rope-span5", basis="layer", family="patchkv-post-span5"),
    _coded(8, "8x-top256", "8x + decode over the best 256 latent tokens per KV head", extra=(patchkv.TopK(256, 16),)),
    _coded(8, "8x-post", "global post-RoPE codes, 8x vs bf16", mode="post_rope"),
    *(_salient(ratio, scorer) for ratio in (8, 16, 32) for scorer in (patchkv.Novelty, patchkv.CodeError,
                                                                       patchkv.KeyNorm, patchkv.AttentionMass)),
    *(_near(ratio, basis) for basis in ("head", "layer") for ratio in (8, 16, 32)),
    *(_near(ratio, basis, patchkv.Novelty(SALIENT_FRACTION)) for basis in ("head", "layer") for ratio in (16, 32)),
    *(_near(ratio, basis, patchkv.Novelty(INT8_FRACTION, bits=8)) for basis in ("head", "layer") for ratio in (16, 32)),
    *(_near(ratio, basis, regions=INT8_WINDOW) for basis in ("head", "layer") for ratio in (8, 16, 32)),
    *(_near(ratio, "layer", patchkv.Novelty(INT8_FRACTION, bits=8), INT8_WINDOW) for ratio in (16, 32)),
    *(_near(ratio, "head", regions=INT8_WINDOW, near=NEAR4) for ratio in (8, 16, 32)),
    *(_near(ratio, "layer", patchkv.Novelty(INT8_FRACTION, bits=8), INT8_WINDOW, NEAR4) for ratio in (8, 16, 32)),
    _near(32, "layer", patchkv.Novelty(NEAR6_INT8_FRACTION, bits=8), INT8_WINDOW, NEAR6),
    _near(32, "layer", INT4_COPIES, INT8_WINDOW, NEAR6),
    *(_evicting(ratio) for ratio in (16, 32)),
    _evicting(16, 0.2),
    _evicting(32, EVICT32_FRACTION),
    # dropped by the attention the context's last queries pay (SnapKV's observation): for what follows the context, not
    # a needle (scratch runs, float32, ppl_after_* and needle_text samples 0-4: the novelty ones lose perplexity, these
    # needles)
    *(_evicting(ratio, fraction, "attention_mass") for ratio, fraction in ((16, 0.3), (32, EVICT32_FRACTION))),
)}


#: the families the suite's accuracy plot draws (`python -m evals table`; `--families all` draws every one, and the CSV
#: and table always hold every configuration): the unpatched model, `QuantizedCache`, patchkv's plain codes, near
#: codes on per-head bases, the configurations that meet the most targets (8x-32x near4 with int8 copies; 32x near6
#: with int4 copies), and kvpress's presses measured at 16x and 32x
PLOTTED = ("unpatched", "quantized_cache", "patchkv", "patchkv+near", "patchkv-layer+near4+novelty+int8+w8",
           "patchkv-layer+near6+novelty+int4+w8", "kvpress KVzipPress", "kvpress SnapKVPress", "kvpress TOVAPress",
           "kvpress StreamingLLMPress")


def config(name: str) -> Config:
    """The registered configuration `name`, or a peer's (evals/peers) known by its name alone."""
    return CONFIGS.get(name) or peer(name)


class Artifacts(Mapping):
    """SmolLM2's artifacts by the name configurations ask for them (`Config.mode`), in `dtype`, each loaded the first
    time it is asked for: "pre_rope" and "post_rope" (the shipped bases in `bases`), "pre_rope-spanS" and
    "post_rope-spanS" (bases across S layers, `span_artifact`, built the first time)."""

    def __init__(self, dtype: torch.dtype, bases: Path = BASES):
        self.dtype, self.bases, self.loaded = dtype, bases, {}
        self.names = ("pre_rope", "post_rope", *(f"{mode}-span{span}" for mode in ("pre_rope", "post_rope")
                                                   for span in SPANS))

    def __getitem__(self, name: str) -> patchkv.Artifact:
        if name not in self.names:
            raise KeyError(name)
        if name not in self.loaded:
            mode, _, span = name.partition("-span")
            file = span_artifact(int(span), self.bases, mode) if span else self.bases / f"{mode}.safetensors"
            self.loaded[name] = patchkv.Artifact.load(file).to_dtype(self.dtype)
        return self.loaded[name]

    def __contains__(self, name: object) -> bool:  # without loading it (Mapping's would)
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_artifacts(dtype: torch.dtype | None = None, bases: Path = BASES) -> Artifacts:
    """SmolLM2's artifacts by name (`Artifacts`) in `dtype` (default `models_dtype()`)."""
    return Artifacts(dtype or models_dtype(), bases)


def span_artifact(span: int, bases: Path = BASES, mode: str = "pre_rope") -> Path:
    """The shipped `mode` artifact in `bases` with its layer bases calibrated across `span` layers (format version
    7), in `SPAN_BASES`/span: built there the first time (`python -m evals calibrate --layer-bases-only
    --layers-per-basis span --modes mode`, 3 to 6 minutes on 2 cores, deterministic)."""
    out = SPAN_BASES / str(span)
    file = out / f"{mode}.safetensors"
    if not file.exists():  # built beside, then moved in whole: an interrupted build leaves no file
        from .calibrate_smollm2 import main as calibrate

        print(f"building the bases across {span} layers into {file} (once)", flush=True)
        partial = SPAN_BASES / f"{span}.partial"
        partial.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bases / file.name, partial / file.name)
        calibrate(["--layer-bases-only", "--layers-per-basis", str(span), "--modes", mode, "--out", str(partial)])
        out.mkdir(exist_ok=True)
        (partial / file.name).replace(file)
        partial.rmdir()
    return file


@cache
def sixteen_bit_bytes_per_token() -> float:
    """Bytes per token of SmolLM2's bf16 cache (every layer holds every token), from its shipped artifact."""
    return sixteen_bit_bytes(patchkv.Artifact.load(BASES / "pre_rope.safetensors"))


def load_gemma3(dtype: torch.dtype | None = None):
    """(model, tokenizer): Gemma 3 270M from the folder `scripts/setup.sh` writes, in eval mode, in `dtype` (default
    `models_dtype()`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=dtype or models_dtype()).eval(),
            AutoTokenizer.from_pretrained(GEMMA3))


def prefill(model, ids: torch.Tensor, cache, chunk: int = 1024) -> None:
    """ids `[batch, n]` into `cache`, `chunk` tokens a forward, logits of each forward's last token only."""
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1)


def text_ids(tokenizer, text: str, length: int) -> torch.Tensor:
    """`[1, n]`: the first `length` tokens of `text`, after the tokenizer's BOS where it has one (as `patchkv report`
    feeds a text)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return torch.tensor([(bos + tokenizer(text, add_special_tokens=False)["input_ids"])[:length]])


def perplexity(model, ids: torch.Tensor, artifact: patchkv.Artifact | None = None, methods: Sequence | None = None,
               chunk: int = 64):
    """`ids` `[1, seq]` scored `chunk` tokens per forward (`patchkv.perplexity.token_nll`), through the cache
    `methods` on `artifact` make, or unpatched where `methods` is None."""
    with nullcontext() if methods is None else patchkv.patched(model, artifact, list(methods)):
        return token_nll(model, ids, chunk)


def perplexity_fields(scored, base: float, context: int, extra_bytes: float = 0.0) -> dict:
    """A research row's measured columns: the KV bytes per token the scored cache held over `context` tokens (+
    `extra_bytes`), the perplexity and its change in percent against `base`."""
    return {"kv_bytes_per_token": round(cache_nbytes(scored.cache) / context + extra_bytes, 1),
            "perplexity": round(scored.perplexity, 4), "change_pct": round(100 * (scored.perplexity / base - 1), 2)}


def read_csv(path: Path) -> list[dict]:
    """The rows of the CSV `path`, as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(rows: Sequence[dict], path: Path, fields: Sequence[str] | None = None, extra: dict | None = None) -> Path:
    """`rows` to the CSV `path` (its folder made where missing), columns `fields` (default: the first row's keys; a
    row without one writes it empty), with its provenance sidecar (`extra` added to it)."""
    fields = list(fields or rows[0])
    unknown = {key for row in rows for key in row} - set(fields)
    if unknown:
        raise ValueError(f"{path.name}: columns {sorted(unknown)} are not among {fields}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_rows(path, fields, [[row.get(f, "") for f in fields] for row in rows])
    write_provenance(path, extra)
    print(f"wrote {path}")
    return path


def write_provenance(path: Path, extra: dict | None = None) -> Path:
    """`<path>.provenance.json` beside a result file."""
    side = path.with_name(path.name + ".provenance.json")
    models = str(models_dtype()).removeprefix("torch.")  # what `load_smollm2` / `load_gemma3` load in here
    side.write_text(json.dumps({**provenance(), "models_dtype": models, **(extra or {})}, indent=2) + "\n")
    return side
