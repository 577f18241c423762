"""Research: eviction beside codes. Does dropping part of the middle, and coding the rest at a higher rate from the
same bytes, keep a needle in real prose better than coding every token at the budget's rate?

    PATCHKV_EVALS_DTYPE=float32 .venv/bin/python -m evals eviction --variants 16x,8x:novelty:0.6,8x:random:0.6 \\
        --tasks needle_text --samples 30 --threads 2

A variant is `CONFIG` (a suite configuration, or a budget such as "12x" on the shipped pre-RoPE bases, which hold
step scales for 4x, 8x and 16x only) or `CONFIG:SCORER:FRACTION`: after the context's one-forward prefill (RULER's
protocol, `evals/tasks.py`), each full-attention layer drops the `FRACTION` of its coded tokens that `SCORER` ranks
lowest, the same tokens for every KV head of the layer (the salience methods' layer scope), and later forwards (the
question, the answer's decode steps, a continuation) never read them. Scorers, from the tokens'
exact keys and values in cache space as the prefill made them:

- `novelty`: `patchkv.Novelty`'s score (distance to the nearest of 256 other tokens; a needle's digits have none);
- `novelty_pool`: the same, max-pooled over 7 neighbouring tokens (SnapKV's pooling: a kept token keeps its
  neighbours, the words around a number);
- `random`: a seeded draw, the control.

A simulation, not a method: the dropped tokens stay in the cache and are masked out of attention (an additive mask
on their columns, in both the dense and the decode path). Their bytes are not counted: the KV bytes per token are
the cache's minus the dropped tokens' codes, plus a kept-token bitmap (one bit per coded token and layer) a cache
would need; the shared int32 positions stay. Run in float32 on a CPU without native bf16 (the exact sinks and window
then hold 4 bytes a number: compare bytes within one dtype). Results: `<--name>.csv` (+ provenance): variant, task,
sample, score (a needle found 1/0; a continuation's NLL sum over `count` tokens), bytes, prediction.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

import patchkv
from patchkv import attention
from patchkv.budgets import parse_budget
from patchkv.cache import LatentCache, LatentLayer
from patchkv.methods import Salience

from .suite import CONFIGS, SMOLLM2, config, load_artifacts, load_smollm2, write_csv
from .tasks import TASKS, Continuation
from .verbs import parse, parser

SCORERS = ("novelty", "novelty_pool", "random")
FIELDS = ("variant", "task", "index", "score", "count", "kv_bytes_per_token", "dropped", "prediction")
#: tokens on each side a pooled score reaches
POOL = 3


@dataclass
class Dropping:
    """What one sample's drop has captured and decided: each layer's prefill keys and values (cache space), the
    tokens each layer drops (a bool over the cache's columns) and the bytes their codes held."""

    scorer: str
    fraction: float
    seed: int
    prefill: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dropped: dict[int, torch.Tensor] = field(default_factory=dict)
    freed: float = 0.0
    bitmap: float = 0.0
    capturing: bool = True


def parse_variant(text: str) -> tuple[str, str | None, float]:
    """"16x" -> ("16x", None, 0.0); "8x:novelty:0.6" -> ("8x", "novelty", 0.6)."""
    name, *rest = text.split(":")
    if not rest:
        return name, None, 0.0
    if len(rest) != 2 or rest[0] not in SCORERS:
        raise SystemExit(f"eviction: variant {text!r} is not CONFIG or CONFIG:SCORER:FRACTION with SCORER one of "
                         f"{', '.join(SCORERS)}.")
    fraction = float(rest[1])
    if not 0.0 < fraction < 1.0:
        raise SystemExit(f"eviction: variant {text!r}: the fraction dropped must be in (0, 1).")
    return name, rest[0], fraction


def scores(state: Dropping, lp, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One score per coded token of a layer (higher kept), from keys and values `[1, kv_heads, n, head_dim]`: float32
    `[n]`, averaged over the KV heads."""
    n = keys.shape[2]
    if state.scorer == "random":
        return torch.rand(n, generator=torch.Generator().manual_seed(state.seed * 1000 + lp.layer_idx))
    score = patchkv.Novelty().score(lp, keys.float(), values.float(), None).mean(1)[0]
    if state.scorer == "novelty_pool":
        score = torch.nn.functional.max_pool1d(score[None, None], 2 * POOL + 1, 1, POOL)[0, 0]
    return score


def decide(state: Dropping, lp, layer: LatentLayer) -> torch.Tensor:
    """The columns layer `lp` drops, chosen once, at its first forward after the prefill: bool `[columns]`."""
    keys, values = state.prefill.pop(lp.layer_idx)
    start, coded = layer.sink_len, layer.coded_len
    drop = int(state.fraction * coded)
    order = scores(state, lp, keys[:, :, start:start + coded], values[:, :, start:start + coded]).argsort()
    dropped = torch.zeros(keys.shape[2], dtype=torch.bool)
    dropped[order[:drop] + start] = True
    stored = layer.tensors["latent_keys"].nbytes + layer.tensors["latent_values"].nbytes
    state.freed += drop * stored / max(1, layer.middle_len)
    state.bitmap += math.ceil(coded / 8)
    return dropped


@contextmanager
def dropping(state: Dropping):
    """Patched attention masks what `state` drops (module doc) while inside; everything is restored on exit."""
    forward, append = attention.attention_forward, LatentLayer.append

    def capture(layer, keys, values, positions):
        if state.capturing:
            state.prefill[layer.patch.layer_idx] = (keys.detach().clone(), values.detach().clone())
        return append(layer, keys, values, positions)

    def masked(attn, lp, layer, hidden_states, position_embeddings, mask, **kwargs):
        past = layer.get_seq_length()
        if past and lp.sliding_window is None:
            state.capturing = False
            if lp.layer_idx not in state.dropped:
                state.dropped[lp.layer_idx] = decide(state, lp, layer)
            mask = with_dropped(mask, state.dropped[lp.layer_idx], past, hidden_states)
        return forward(attn, lp, layer, hidden_states, position_embeddings, mask, **kwargs)

    attention.attention_forward, LatentLayer.append = masked, capture
    try:
        yield state
    finally:
        attention.attention_forward, LatentLayer.append = forward, append


def with_dropped(mask: torch.Tensor | None, dropped: torch.Tensor, past: int, hidden: torch.Tensor) -> torch.Tensor:
    """The additive mask `[batch, 1, seq, past + seq]` of a forward of `seq` queries after `past` tokens: causal (or
    the model's `mask`), with the `dropped` columns masked out."""
    seq = hidden.shape[1]
    total = past + seq
    columns, rows = torch.arange(total), torch.arange(seq) + past
    bias = torch.zeros(seq, total).masked_fill(columns[None] > rows[:, None], -math.inf)
    bias[:, :dropped.numel()].masked_fill_(dropped[None], -math.inf)
    bias = bias[None, None]
    if mask is not None:
        bias = attention._additive(mask)[..., -total:] + bias  # the model's mask as patched attention reads it
    return bias.to(hidden.dtype)


def main(argv: list[str] | None = None) -> None:
    p = parser("eviction", __doc__, name="eviction")
    p.add_argument("--variants", default="16x,8x:novelty:0.6,8x:random:0.6",
                   help="CONFIG or CONFIG:SCORER:FRACTION, comma-separated")
    p.add_argument("--tasks", default="needle_text", help="suite tasks run by RULER's protocol (needle_text, "
                                                          "ruler_niah_single_1, ppl_after_prose, ...)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--first", type=int, default=0, help="the first sample's index")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    rows = []
    for task_name in args.tasks.split(","):
        task = TASKS[task_name]
        samples = task.samples(4096, args.first + args.samples, SMOLLM2)[args.first:]
        for variant in args.variants.split(","):
            name, scorer, fraction = parse_variant(variant)
            patch = config(name).patch(artifacts, 4096) if name in CONFIGS else \
                (artifacts["pre_rope"], parse_budget(name).methods(artifacts["pre_rope"], 4096))
            if patch is None and scorer is not None:
                raise SystemExit(f"eviction: {name} keeps no codes to drop from; name a patchkv configuration.")
            if scorer is not None and any(isinstance(m, (patchkv.NearCodes, patchkv.Evict, Salience)) for m in patch[1]):
                raise SystemExit(f"eviction: {name} keeps near codes or salient copies, whose dropped tokens this "
                                 "simulation does not count; name a configuration with codes and exact regions only.")
            for sample in samples:
                state = Dropping(scorer, fraction, sample["index"]) if scorer else None
                with torch.no_grad():
                    if patch is None:  # the model's own cache
                        scored = task.run(model, tokenizer, sample, None, name)
                    else:
                        with patchkv.patched(model, *patch), dropping(state) if state else nullcontext():
                            scored = task.run(model, tokenizer, sample, LatentCache(model), variant)
                tokens = len(sample["context_ids"]) + (0 if isinstance(task, Continuation) else
                                                        len(sample["question_ids"]))
                freed = 0.0 if state is None else state.freed - state.bitmap
                held = scored.kv_bytes_per_token - freed / tokens
                rows.append({"variant": variant, "task": task_name, "index": sample["index"], "score": scored.score,
                             "count": scored.count, "kv_bytes_per_token": round(held, 1),
                             "dropped": fraction, "prediction": scored.prediction})
                print(f"{variant} {task_name} #{sample['index']}: {scored.score:g} {held:.0f} B/token "
                      f"{scored.prediction[:30]!r}", flush=True)
                write_csv(rows, args.out / f"{args.name}.csv", FIELDS)


if __name__ == "__main__":
    main()
