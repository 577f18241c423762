"""Research harness: which KV compression holds accuracy on SmolLM2-135M? Simulated compression, measured ppl.

    .venv/bin/python evals/explore_accuracy.py --configs main        # runs what is not cached yet
    .venv/bin/python evals/explore_accuracy.py --list                # the config names

Library-independent: it replaces the forward of every LlamaAttention module with its own (eager, float32)
that computes pre-RoPE keys and values, replaces each one by decode(encode(x)) (simulated compression),
rotates keys by position and attends. For a query at position i, key/value j is exact if it is one of the
first S tokens (sinks) or one of the last W tokens up to i (recent window, j > i - W); otherwise the
compressed version is used. Scores are token perplexity over fixed held-out windows (Shakespeare works held
out of calibration, Milton, Python-docs prose), the same windows for every config.

Bytes per token are counted at a stated context (--context, 4096): sinks and window in bf16, every other
token's codes (and scales, if any), all layers, K and V; bf16 KV is 2*30*3*64*2 = 23040 bytes per token.

Methods (see `CONFIGS`):
  kivi        KIVI-style min-max fake quantization, keys per channel (groups along tokens, post-RoPE as
              quanto/KIVI cache them), values per token (groups along channels); fp16 scale+zero per group.
  rank        PCA rank truncation, bf16 coefficients.
  tc          transform coding: PCA (optionally effect-weighted) + Gaussian-matched uniform scalar quantizer
              per component, bits from one global pool across layers, heads, K and V (greedy = optimal for
              these convex distortion curves: patchkv.allocation.allocate_bits_global).
Weightings of the transform coder (what the error of each component is measured in):
  mse         plain PCA of k and v, error = squared error of k / v (keys and values in their own units).
  fisher      the effect on the loss: F = E[g g^T], g = d loss / d (compressed copy of k or v) of each token,
              collected by a backward pass where only the compressed path (not sinks/window) carries the
              perturbation. Basis = PCA of the whitened problem (eigh of L^T C L, F = L L^T); eigenvalues are
              then in loss units, comparable across layers, heads, K and V -> one global bit pool.
  fdiag       plain PCA basis, component j weighted by u_j^T F u_j (effect weight, basis unchanged).
  attn        analytic shapes: keys weighted by the attention-weighted query covariance (error of q.k over
              query/key pairs the compressed region serves, queries rotated to the relative offset), values by
              sum_g W_o^(g)T W_o^(g) over the query heads of the KV head; each (layer, head, kind) scaled so the
              total weighted variance equals the Fisher one (the common unit a global pool needs).
Calibration statistics are cached under .cache/explore/ (gitignored); results append to
evals/results/smollm2_explore.csv (one row per config, measured).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from patchkv.allocation import allocate_bits_global, weighted_pca  # noqa: E402
from patchkv.quantize import GAUSSIAN_STEP  # noqa: E402

MODEL = ROOT / ".models" / "SmolLM2-135M-Instruct"
CACHE = ROOT / ".cache" / "explore"
CSV = ROOT / "evals" / "results" / "smollm2_explore.csv"
BF16_TOKEN_BYTES = None  # set from the model config: 2 * layers * kv_heads * head_dim * 2


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------
def _texts(domain: str) -> list[str]:
    from patchkv import corpus

    if domain == "shakespeare":
        return corpus.shakespeare_held_out()
    if domain == "milton":
        return corpus.milton()
    if domain == "prose":
        rows = (ROOT / "patchkv" / "tasks" / "data" / "prose_heldout.jsonl").read_text().splitlines()
        return ["\n\n".join(json.loads(r)["text"] for r in rows)]
    if domain == "cal_shakespeare":
        return corpus.shakespeare_train()
    if domain == "cal_prose":
        return [(ROOT / "evals" / "data" / "prose_calibration.txt").read_text()]
    raise ValueError(domain)


def windows(tokenizer, domain: str, n: int, length: int) -> torch.Tensor:
    """n windows of `length` tokens spread evenly over the domain's concatenated token stream: `[n, length]`."""
    ids = torch.cat([torch.tensor(tokenizer(t)["input_ids"]) for t in _texts(domain)])
    stride = (len(ids) - length) // max(n - 1, 1)
    return torch.stack([ids[i * stride: i * stride + length] for i in range(n)])


def calibration_windows(tokenizer, calib: str, n: int, length: int) -> torch.Tensor:
    if calib == "mix":  # half verse (Shakespeare training works), half technical prose (Python docs)
        a = windows(tokenizer, "cal_shakespeare", n - n // 2, length)
        b = windows(tokenizer, "cal_prose", n // 2, length)
        return torch.cat([a, b])[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    return windows(tokenizer, f"cal_{calib}", n, length)


# ----------------------------------------------------------------------------------------------------------------
# the attention forward
# ----------------------------------------------------------------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


@dataclass
class State:
    mode: str = "exact"            # exact | compress | stats
    sinks: int = 4
    window: int = 32
    codecs: dict = field(default_factory=dict)     # layer -> (key codec, value codec), callables on [B, H, N, d]
    kivi: tuple | None = None       # (bits, group)
    stats: dict = field(default_factory=dict)      # collected in stats mode
    deltas: dict = field(default_factory=dict)     # layer -> (dk, dv) leaves, stats mode
    qsample: int = 8                # query positions sampled per window for the attention-weighted Cq


STATE = State()


def exact_mask(n: int, sinks: int, window: int, device) -> torch.Tensor:
    """[n, n] bool: key j is held exactly for query i (sink or within the recent window); causal not applied."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j < sinks) | (j > i - window)


def kivi_fake(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization of x `[B, H, N, d]` in groups of `group` along `dim` (2: tokens, 3: channels)."""
    x = x.transpose(dim, -1)
    shape = x.shape
    n = shape[-1]
    pad = (-n) % group
    xp = F.pad(x, (0, pad), value=float("nan")) if pad else x
    g = xp.reshape(*shape[:-1], -1, group)
    lo = torch.nan_to_num(g, nan=float("inf")).amin(-1, keepdim=True)
    hi = torch.nan_to_num(g, nan=float("-inf")).amax(-1, keepdim=True)
    lo, hi = lo.half().float(), hi.half().float()  # fp16 scale/zero, as counted
    scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8)
    q = torch.round((g - lo) / scale).clamp(0, 2 ** bits - 1)
    out = (q * scale + lo).reshape(*shape[:-1], -1)[..., :n]
    return out.transpose(dim, -1)


def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    st = STATE
    layer = self.layer_idx
    b, n, _ = hidden_states.shape
    hd = self.head_dim
    q = self.q_proj(hidden_states).view(b, n, -1, hd).transpose(1, 2)
    k = self.k_proj(hidden_states).view(b, n, -1, hd).transpose(1, 2)   # pre-RoPE
    v = self.v_proj(hidden_states).view(b, n, -1, hd).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    groups = self.num_key_value_groups
    qr, kr = rope(q, cos, sin), rope(k, cos, sin)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    kx = kr.repeat_interleave(groups, 1)
    vx = v.repeat_interleave(groups, 1)
    s_exact = (qr @ kx.transpose(-1, -2)) * self.scaling
    if st.mode == "exact":
        p = torch.softmax(s_exact.masked_fill(~causal, float("-inf")), -1)
        out = p @ vx
    else:
        exact = exact_mask(n, st.sinks, st.window, q.device)
        if st.mode == "stats":
            dk = torch.zeros_like(k, requires_grad=True)
            dv = torch.zeros_like(v, requires_grad=True)
            st.deltas[layer] = (dk, dv)
            kc, vc = rope(k + dk, cos, sin), v + dv
            collect_moments(layer, k.detach(), v.detach(), qr.detach(), q.detach(), s_exact.detach(), causal, exact,
                            cos, sin)
        elif st.kivi is not None:
            bits, group = st.kivi
            kc, vc = kivi_fake(kr, bits, group, dim=2), kivi_fake(v, bits, group, dim=3)
        else:
            kcod, vcod = st.codecs[layer]
            kc, vc = rope(kcod(k), cos, sin), vcod(v)
        s_comp = (qr @ kc.repeat_interleave(groups, 1).transpose(-1, -2)) * self.scaling
        s = torch.where(exact, s_exact, s_comp).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, -1)
        out = (p * exact) @ vx + (p * ~exact) @ vc.repeat_interleave(groups, 1)
    out = out.transpose(1, 2).reshape(b, n, -1)
    return self.o_proj(out), None


def patch(model: nn.Module) -> None:
    for m in model.modules():
        if type(m).__name__ == "LlamaAttention":
            m.forward = attention_forward.__get__(m)


# ----------------------------------------------------------------------------------------------------------------
# calibration statistics
# ----------------------------------------------------------------------------------------------------------------
def _acc(name: str, layer: int, value: torch.Tensor) -> None:
    d = STATE.stats.setdefault(name, {})
    d[layer] = d.get(layer, 0) + value.double()


def collect_moments(layer, k, v, qr, q, s_exact, causal, exact, cos, sin) -> None:
    """Moments of pre-RoPE k and v over non-sink tokens (joint over KV heads: [H*d] vectors), and the
    attention-weighted query second moment of each KV head, queries rotated to the relative offset."""
    st = STATE
    b, h, n, d = k.shape
    keep = slice(st.sinks, n)
    kk = k[:, :, keep].permute(0, 2, 1, 3).reshape(-1, h * d)
    vv = v[:, :, keep].permute(0, 2, 1, 3).reshape(-1, h * d)
    _acc("k_sum", layer, kk.sum(0)), _acc("k_sq", layer, kk.T.double() @ kk.double())
    _acc("v_sum", layer, vv.sum(0)), _acc("v_sq", layer, vv.T.double() @ vv.double())
    _acc("count", layer, torch.tensor(float(kk.shape[0])))
    # attention-weighted relative query covariance: score(i, j) = rope(q_i, i - j) . k_j (un-rotated k_j)
    g = q.shape[1] // h
    p = torch.softmax(s_exact.masked_fill(~causal, float("-inf")), -1)       # [b, H*g, n, n]
    comp = (~exact) & causal
    lo = st.sinks + st.window
    if n <= lo:
        return
    gen = torch.Generator().manual_seed(1000 + layer)
    rows = torch.randint(lo, n, (st.qsample,), generator=gen)
    inv_freq = None
    m = torch.zeros(h, d, d, dtype=torch.float64)
    for i in rows.tolist():
        js = torch.nonzero(comp[i]).flatten()
        if len(js) == 0:
            continue
        rel = (i - js).float()                                             # [J]
        # cos/sin for relative positions: recompute from the rotary frequencies implied by cos at positions 0, 1
        if inv_freq is None:
            inv_freq = torch.atan2(sin[0, 0, 1, : d // 2], cos[0, 0, 1, : d // 2])  # angle per unit position
        ang = rel[:, None] * inv_freq[None, :]
        c = torch.cat([ang.cos(), ang.cos()], -1)
        s_ = torch.cat([ang.sin(), ang.sin()], -1)
        for bi in range(b):
            qi = q[bi, :, i]                                                 # [H*g, d]
            x = qi[:, None, :] * c[None] + rotate_half(qi)[:, None, :] * s_[None]  # [H*g, J, d]
            w = p[bi, :, i, js]                                              # [H*g, J]
            xw = (x * w[..., None].sqrt()).reshape(h, g * len(js), d).double()
            m += xw.transpose(1, 2) @ xw
    _acc("qrel", layer, m)


def collect_stats(model, tok, calib: str, n_windows: int, length: int, sinks: int, window: int) -> dict:
    path = CACHE / f"stats_{calib}_n{n_windows}x{length}_s{sinks}_w{window}.pt"
    if path.exists():
        return torch.load(path)
    CACHE.mkdir(parents=True, exist_ok=True)
    data = calibration_windows(tok, calib, n_windows, length)
    STATE.mode, STATE.sinks, STATE.window, STATE.stats = "stats", sinks, window, {}
    layers = model.config.num_hidden_layers
    fk = {l: 0 for l in range(layers)}
    fv = {l: 0 for l in range(layers)}
    ntok = 0
    t0 = time.time()
    for w in range(n_windows):
        ids = data[w: w + 1]
        STATE.deltas = {}
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        loss = out.loss * (ids.shape[1] - 1)   # summed nats over the window
        grads = torch.autograd.grad(loss, [t for l in range(layers) for t in STATE.deltas[l]])
        for l in range(layers):
            gk, gv = grads[2 * l], grads[2 * l + 1]                          # [1, H, N, d]
            h, d = gk.shape[1], gk.shape[3]
            sel = slice(sinks, length - window + 1)                           # tokens ever compressed
            gk = gk[0, :, sel].permute(1, 0, 2).reshape(-1, h * d).double()
            gv = gv[0, :, sel].permute(1, 0, 2).reshape(-1, h * d).double()
            fk[l] = fk[l] + gk.T @ gk
            fv[l] = fv[l] + gv.T @ gv
        ntok += length - window + 1 - sinks
        print(f"  stats {calib} window {w + 1}/{n_windows} ({time.time() - t0:.0f}s)", flush=True)
    s = STATE.stats
    out = {"layers": {}}
    for l in range(layers):
        cnt = s["count"][l]
        mk, mv = s["k_sum"][l] / cnt, s["v_sum"][l] / cnt
        out["layers"][l] = {
            "k_mean": mk, "k_cov": s["k_sq"][l] / cnt - torch.outer(mk, mk),
            "v_mean": mv, "v_cov": s["v_sq"][l] / cnt - torch.outer(mv, mv),
            "k_fisher": fk[l] / ntok, "v_fisher": fv[l] / ntok,
            "q_rel": s["qrel"][l] / n_windows,
        }
    STATE.mode = "exact"
    torch.save(out, path)
    print(f"  stats {calib}: {time.time() - t0:.0f}s -> {path}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# codecs
# ----------------------------------------------------------------------------------------------------------------
class Codec:
    """decode(encode(x)) for x `[B, H, N, d]` with `groups` bases over the flattened [H*d] vector of a token.

    Each group g covers columns `cols[g]`: y = (x - mean) @ enc (components), quantized per component with
    bits[c] bits of a uniform quantizer of step GAUSSIAN_STEP[b] * std[c] * clip (0 bits -> 0), then
    x_hat = mean + y_hat @ dec. Rank mode: keep components with bits > 0 unquantized (bf16)."""

    def __init__(self, parts, quantize: bool = True, clip: float = 1.0, token_scale: bool = False):
        self.parts = parts    # list of (cols, mean, enc, dec, bits, std)
        self.quantize, self.clip, self.token_scale = quantize, clip, token_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, d = x.shape
        flat = x.permute(0, 2, 1, 3).reshape(b, n, h * d)
        out = torch.empty_like(flat)
        for cols, mean, enc, dec, bits, std in self.parts:
            keep = bits > 0
            y = (flat[..., cols] - mean) @ enc[:, keep]
            if self.quantize:
                sd = std[keep]
                scale = 1.0
                if self.token_scale:  # per-token gain (8-bit log code, counted), Gaussian quantizer on y / gain
                    gain = ((y / sd) ** 2).mean(-1, keepdim=True).sqrt().clamp_min(1e-4)
                    gain = torch.exp2(torch.round(torch.log2(gain) * 16) / 16)
                    scale = gain
                lv = 2.0 ** bits[keep].float()
                step = torch.tensor([GAUSSIAN_STEP[int(i)] for i in bits[keep]]) * sd * self.clip * scale
                idx = torch.floor(y / step + lv / 2).clamp(torch.zeros_like(lv), lv - 1)
                y = (idx + 0.5 - lv / 2) * step
            else:
                y = y.bfloat16().float()
            out[..., cols] = mean + y @ dec[keep]
        return out.view(b, n, h, d).permute(0, 2, 1, 3)


def build_bases(st: dict, layer: int, kind: str, weighting: str, joint: bool, heads: int, d: int):
    """List of (cols, mean, enc, dec, lam, w_lam) per group; lam: variances of the components in the weighted
    space (loss units when weighting != mse), descending."""
    L = st["layers"][layer]
    cov, mean, fis = L[f"{kind}_cov"], L[f"{kind}_mean"], L[f"{kind}_fisher"]
    groups = [torch.arange(heads * d)] if joint else [torch.arange(h * d, (h + 1) * d) for h in range(heads)]
    out = []
    for cols in groups:
        c = cov[cols][:, cols]
        f = fis[cols][:, cols]
        if weighting in ("mse", "fdiag"):
            enc, lam = weighted_pca(c, None)
            dec = enc.T
            if weighting == "fdiag":
                lam = lam * torch.einsum("ic,ij,jc->c", enc, f, enc)
        elif weighting == "fisher":
            enc, lam, dec = weighted_pca(c, f, return_decoder=True)
        elif weighting == "attn":
            if kind == "k":
                hidx = int(cols[0]) // d
                a = st["layers"][layer]["q_rel"][hidx] if not joint else torch.block_diag(*st["layers"][layer]["q_rel"])
            else:
                a = st["wo_gram"][layer]
                a = a[cols][:, cols]
            enc, lam, dec = weighted_pca(c, a, return_decoder=True)
            # common unit: total weighted variance = the Fisher one
            lam = lam * (torch.trace(f @ c) / lam.sum().clamp_min(1e-30))
        else:
            raise ValueError(weighting)
        out.append((cols, mean[cols].float(), enc.float(), dec.float(), lam.double()))
    return out


# ----------------------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------------------
def kv_bytes(mid_bits: float, sinks: int, window: int, ctx: int, full: int) -> float:
    exact = min(sinks + window, ctx)
    return (exact * full + (ctx - exact) * mid_bits / 8) / ctx


def target_bits(ratio: float, sinks: int, window: int, ctx: int, full: int, scale_bits: int = 0) -> int:
    """Mid-region bits per token that make the total bytes per token = full / ratio."""
    exact = sinks + window
    mid_bytes = (full / ratio * ctx - exact * full) / (ctx - exact)
    return int(math.floor(mid_bytes * 8)) - scale_bits


CONFIGS: dict[str, dict] = {}


def cfg(name, **kw):
    CONFIGS[name] = kw


def _register():
    cfg("unpatched", method="exact")
    for s, w in ((4, 32),):
        for bits, g in ((4, 32), (2, 32), (4, 64), (2, 64)):
            cfg(f"kivi int{bits} g{g} s{s} w{w}", method="kivi", bits=bits, group=g, sinks=s, window=w)
    cfg("rank32 mse s4 w32", method="rank", rank=32, sinks=4, window=32)
    cfg("rank16 mse s4 w32", method="rank", rank=16, sinks=4, window=32)
    for ratio in (4, 8, 16):
        for wt in ("mse", "fdiag", "fisher", "attn"):
            cfg(f"tc {ratio}x {wt} global s4 w32", method="tc", ratio=ratio, weighting=wt, sinks=4, window=32)
        cfg(f"tc {ratio}x fisher perhead-budget s4 w32", method="tc", ratio=ratio, weighting="fisher", sinks=4,
            window=32, pool="head")
        cfg(f"tc {ratio}x fisher joint s4 w32", method="tc", ratio=ratio, weighting="fisher", sinks=4, window=32,
            joint=True)
        cfg(f"tc {ratio}x fisher global s4 w32 cal=shakespeare", method="tc", ratio=ratio, weighting="fisher",
            sinks=4, window=32, calib="shakespeare")
        cfg(f"tc {ratio}x fisher global s4 w32 cal=prose", method="tc", ratio=ratio, weighting="fisher",
            sinks=4, window=32, calib="prose")
        for s, w in ((1, 32), (4, 0), (4, 16), (4, 64), (1, 8), (4, 8)):
            cfg(f"tc {ratio}x fisher global s{s} w{w}", method="tc", ratio=ratio, weighting="fisher", sinks=s,
                window=w)
        cfg(f"tc {ratio}x fisher global s4 w32 clip1.25", method="tc", ratio=ratio, weighting="fisher", sinks=4,
            window=32, clip=1.25)
        cfg(f"tc {ratio}x fisher global s4 w32 tokscale", method="tc", ratio=ratio, weighting="fisher", sinks=4,
            window=32, token_scale=True)
    # equal-bytes matches to the KIVI baselines (ratios filled in at run time from KIVI's bytes)
    for bits, g in ((4, 32), (2, 32), (2, 64)):
        cfg(f"tc @kivi int{bits} g{g} fisher global s4 w32", method="tc", match_kivi=(bits, g), weighting="fisher",
            sinks=4, window=32)


_register()

PRESETS = {
    "main": ["unpatched", "kivi int4 g32 s4 w32",
             "tc 8x fisher global s4 w32", "tc 4x fisher global s4 w32", "tc 16x fisher global s4 w32",
             "tc @kivi int2 g32 fisher global s4 w32", "kivi int2 g32 s4 w32", "tc 8x mse global s4 w32",
             "tc 8x fdiag global s4 w32", "tc 8x fisher perhead-budget s4 w32",
             "tc 4x mse global s4 w32", "tc 16x mse global s4 w32", "tc @kivi int4 g32 fisher global s4 w32",
             "tc 8x fdiag global s4 w32", "tc 8x attn global s4 w32", "tc 8x fisher perhead-budget s4 w32",
             "tc 8x fisher joint s4 w32", "tc 8x fisher global s4 w32 cal=shakespeare",
             "tc 8x fisher global s4 w32 clip1.25", "tc 8x fisher global s4 w32 tokscale",
             "tc 16x fisher global s4 w16", "rank32 mse s4 w32", "kivi int2 g64 s4 w32"],
    "old": ["unpatched", "kivi int4 g32 s4 w32", "kivi int2 g32 s4 w32", "kivi int2 g64 s4 w32",
             "tc @kivi int4 g32 fisher global s4 w32", "tc @kivi int2 g32 fisher global s4 w32",
             "tc @kivi int2 g64 fisher global s4 w32",
             "tc 4x mse global s4 w32", "tc 8x mse global s4 w32", "tc 16x mse global s4 w32",
             "tc 4x fisher global s4 w32", "tc 8x fisher global s4 w32", "tc 16x fisher global s4 w32",
             "rank32 mse s4 w32"],
}


def kivi_bits_per_token(bits: int, group: int, layers: int, heads: int, d: int) -> float:
    return 2 * layers * heads * d * (bits + 32 / group)


def setup_config(c: dict, stats: dict, model) -> tuple[float, str]:
    """Configure STATE for config c; return (mid-region bits per token, description of the bits)."""
    conf = model.config
    layers, heads, d = conf.num_hidden_layers, conf.num_key_value_heads, conf.head_dim
    full = 2 * layers * heads * d * 2
    STATE.sinks, STATE.window, STATE.kivi, STATE.codecs = c.get("sinks", 4), c.get("window", 32), None, {}
    if c["method"] == "exact":
        STATE.mode = "exact"
        return 16 * full / 2, "bf16"
    STATE.mode = "compress"
    if c["method"] == "kivi":
        STATE.kivi = (c["bits"], c["group"])
        return kivi_bits_per_token(c["bits"], c["group"], layers, heads, d), "kivi"
    joint = c.get("joint", False)
    bases = {(l, kind): build_bases(stats, l, kind, c.get("weighting", "mse"), joint, heads, d)
             for l in range(layers) for kind in ("k", "v")}
    if c["method"] == "rank":
        r = c["rank"]
        for l in range(layers):
            cod = []
            for kind in ("k", "v"):
                parts = []
                for cols, mean, enc, dec, lam in bases[(l, kind)]:
                    bits = torch.zeros(len(lam), dtype=torch.long)
                    bits[:r] = 16
                    parts.append((cols, mean, enc, dec, bits, None))
                cod.append(Codec(parts, quantize=False))
            STATE.codecs[l] = tuple(cod)
        return 2 * layers * heads * r * 16, "bf16 coefficients"
    # transform coding
    scale_bits = 0
    n_groups = layers * 2 * (1 if joint else heads)
    if c.get("token_scale"):
        scale_bits = 8 * n_groups
    if "match_kivi" in c:
        kb, kg = c["match_kivi"]
        budget = int(kivi_bits_per_token(kb, kg, layers, heads, d)) - scale_bits
    else:
        budget = target_bits(c["ratio"], STATE.sinks, STATE.window, 4096, full, scale_bits)
    keys = list(bases)
    lams = [lam for key in keys for (_, _, _, _, lam) in bases[key]]
    sizes = [len(x) for x in lams]
    if c.get("pool", "global") == "global":
        bits_all = allocate_bits_global(torch.cat(lams), budget)
    else:  # fixed budget per group (head), DP/greedy inside each group
        per = budget // len(lams)
        bits_all = torch.cat([allocate_bits_global(x, per) for x in lams])
    chunks = list(torch.split(bits_all, sizes))
    it = iter(chunks)
    used = int(bits_all.sum()) + scale_bits
    for l in range(layers):
        cod = []
        for kind in ("k", "v"):
            parts = []
            for cols, mean, enc, dec, lam in bases[(l, kind)]:
                bits = next(it)
                # quantizer std of each component in its own (weighted) coordinates = sqrt(lam / unit scale);
                # compute it directly from the covariance to be exact for every weighting
                c_ = stats["layers"][l][f"{kind}_cov"][cols][:, cols].float()
                std = torch.einsum("ic,ij,jc->c", enc, c_, enc).clamp_min(1e-12).sqrt()
                parts.append((cols, mean, enc, dec, bits, std))
            cod.append(Codec(parts, clip=c.get("clip", 1.0), token_scale=c.get("token_scale", False)))
        STATE.codecs[l] = tuple(cod)
    return used, f"{used} bits"


# ----------------------------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, data: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for w in range(data.shape[0]):
        ids = data[w: w + 1]
        logits = model(ids).logits[0, :-1].float()
        nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="main", help="preset name, or ';'-separated config names, or 'all'")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--eval-windows", type=int, default=6)
    ap.add_argument("--eval-length", type=int, default=512)
    ap.add_argument("--cal-windows", type=int, default=8)
    ap.add_argument("--cal-length", type=int, default=512)
    ap.add_argument("--calib", default="mix", help="default calibration set: mix | shakespeare | prose")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.list:
        print("\n".join(CONFIGS))
        return
    torch.set_num_threads(args.threads)
    names = (list(CONFIGS) if args.configs == "all" else PRESETS.get(args.configs) or args.configs.split(";"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    patch(model)
    conf = model.config
    layers, heads, d, qh = conf.num_hidden_layers, conf.num_key_value_heads, conf.head_dim, conf.num_attention_heads
    full = 2 * layers * heads * d * 2
    evals = {dom: windows(tok, dom, args.eval_windows, args.eval_length) for dom in ("shakespeare", "milton", "prose")}
    done = {}
    if CSV.exists():
        with CSV.open() as f:
            done = {r["config"]: r for r in csv.DictReader(f)}
    stats_cache: dict = {}

    def stats_for(c):
        calib = c.get("calib", args.calib)
        key = (calib, c.get("sinks", 4), c.get("window", 32))
        if key not in stats_cache:
            s = collect_stats(model, tok, calib, args.cal_windows, args.cal_length, key[1], key[2])
            s["wo_gram"] = {}
            for l, layer in enumerate(model.model.layers):
                wo = layer.self_attn.o_proj.weight.detach().double().view(-1, qh, d)  # [hidden, qheads, d]
                g = qh // heads
                blocks = [sum(wo[:, h * g + j].T @ wo[:, h * g + j] for j in range(g)) for h in range(heads)]
                s["wo_gram"][l] = torch.block_diag(*blocks)
            stats_cache[key] = s
        return stats_cache[key]

    base = None
    if "unpatched" in done:
        base = {dom: float(done["unpatched"][f"ppl_{dom}"]) for dom in evals}
    fields = ["config", "method", "calib", "sinks", "window", "context", "mid_bits_per_token", "kv_bytes_per_token",
              "compression_vs_bf16"] + [f"ppl_{d_}" for d_ in evals] + [f"delta_{d_}_pct" for d_ in evals] + [
              "eval_tokens_per_domain", "seconds"]
    new_file = not CSV.exists()
    CSV.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in done:
            continue
        c = CONFIGS[name]
        t0 = time.time()
        stats = stats_for(c) if c["method"] in ("tc", "rank") else None
        mid_bits, _ = setup_config(c, stats, model)
        ppl = {dom: perplexity(model, data) for dom, data in evals.items()}
        STATE.mode = "exact"
        if c["method"] == "exact":
            kvb = full
            base = ppl
        else:
            kvb = kv_bytes(mid_bits, STATE.sinks, STATE.window, args.context, full)
        row = {"config": name, "method": c["method"], "calib": c.get("calib", args.calib) if stats else "",
               "sinks": STATE.sinks if c["method"] != "exact" else "", "window": STATE.window if c["method"] != "exact" else "",
               "context": args.context, "mid_bits_per_token": round(mid_bits, 1), "kv_bytes_per_token": round(kvb, 1),
               "compression_vs_bf16": round(full / kvb, 3),
               **{f"ppl_{dom}": round(v, 4) for dom, v in ppl.items()},
               **{f"delta_{dom}_pct": round(100 * (v / base[dom] - 1), 2) if base else "" for dom, v in ppl.items()},
               "eval_tokens_per_domain": args.eval_windows * args.eval_length, "seconds": round(time.time() - t0)}
        with CSV.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            if new_file:
                w.writeheader()
                new_file = False
            w.writerow(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
