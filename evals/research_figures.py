"""The research figures, measured on the real SmolLM2-135M-Instruct (30 layers, 3 KV heads of head_dim 64).

    .venv/bin/python -m evals figures capture      # forward passes; caches K/V moments and K/V/Q to .cache/research
    .venv/bin/python -m evals figures fig1         # L2 / score error vs matrix size, per method
    .venv/bin/python -m evals figures fig2         # cross-domain relative error vs calibration tokens
    .venv/bin/python -m evals figures fig3         # relative error vs context position, sinks in/out of calibration
    .venv/bin/python -m evals figures fig4         # DP bit allocation vs component index (per head and global)
    .venv/bin/python -m evals figures fig5         # RoPE and the PCA directions of one head

`capture` runs every forward pass once (single thread, float32, sdpa attention) and stores:
  - calibration moments (float64 sums and outer products per layer and KV head) of pre-RoPE keys, post-RoPE keys
    and values, on 512-token sequences of the verse (Shakespeare training works) and prose (Python docs calibration
    file) calibration sides, with snapshots at 1k, 2k, ... 64k tokens, the first SINKS positions of each sequence
    accumulated separately (so bases with and without sinks come from the same pass);
  - held-out sequences of 8192 tokens (SmolLM2's context): three of Shakespeare's held-out plays (concatenated) and
    one of the held-out prose, with pre-RoPE keys and values at every position and rotated queries at every 8th
    position (p % 8 == 7, so every key has a later query of its own sequence).
The figure subcommands only read that cache (seconds to a few minutes each).
"""

from __future__ import annotations

import json
import os
import time

import torch

from .suite import RESULTS, ROOT, SMOLLM2, write_csv
from .verbs import parse, parser

MODEL = SMOLLM2
CACHE = ROOT / ".cache" / os.environ.get("RESEARCH_CACHE", "research")
SEQ_LEN, BATCH, SINKS = 512, 2, 4
CHECKPOINTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
HELD_LEN, QUERY_EVERY = int(os.environ.get("RESEARCH_HELD_LEN", 8192)), 8
KINDS = ("pre", "post", "val")


# ----- data ----------------------------------------------------------------------------------------------------


def load_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(MODEL)


def tokens_of(texts, tokenizer, needed: int) -> torch.Tensor:
    """The first `needed` tokens of the texts joined by blank lines (tokenized text by text, in 200k-char pieces)."""
    ids: list[int] = []
    for text in texts:
        for start in range(0, len(text), 200_000):
            ids += tokenizer(text[start:start + 200_000], add_special_tokens=False)["input_ids"]
            if len(ids) >= needed:
                return torch.tensor(ids[:needed])
        ids += tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    if len(ids) < needed:
        raise ValueError(f"only {len(ids)} tokens, {needed} needed")
    return torch.tensor(ids[:needed])


def calibration_texts(domain: str) -> list[str]:
    from patchkv.corpus import shakespeare_train

    if domain == "verse":
        return shakespeare_train()
    return [(ROOT / "evals" / "data" / "prose_calibration.txt").read_text()]


def heldout_texts(domain: str) -> list[str]:
    from patchkv.corpus import shakespeare_held_out

    if domain == "verse":
        return shakespeare_held_out()
    lines = (ROOT / "patchkv" / "tasks" / "data" / "prose_heldout.jsonl").read_text().splitlines()
    return ["\n\n".join(json.loads(line)["text"] for line in lines if line.strip())]


# ----- capture -------------------------------------------------------------------------------------------------


def capture(args) -> None:
    from patchkv.adapters import adapter_for, attention_modules

    CACHE.mkdir(parents=True, exist_ok=True)
    model, tok = load_model()
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    layers = len(modules)
    heads, dim = modules[0].config.num_key_value_heads, modules[0].head_dim
    state: dict = {}

    def hook(attn, a, kw):
        hidden = kw["hidden_states"] if "hidden_states" in kw else a[0]
        q, k, v = adapter.project_qkv(attn, hidden)
        cos, sin = kw["position_embeddings"]
        i = attn.layer_idx
        if state["mode"] == "calib":
            xs = {"pre": k, "post": adapter.rotate(k, cos, sin), "val": v}
            for kind, x in xs.items():
                x = x.double()  # [b, heads, seq, d]
                for group, part in (("sink", x[:, :, :SINKS]), ("rest", x[:, :, SINKS:])):
                    m = state["moments"][kind][group]
                    flat = part.transpose(0, 1).reshape(heads, -1, dim)
                    m["total"][i] += flat.sum(1)
                    m["outer"][i] += flat.transpose(1, 2) @ flat
                    if i == 0 and kind == "pre":
                        state["counts"][group] += flat.shape[1]
        else:
            state["pre"][i] = k[0].clone()
            state["val"][i] = v[0].clone()
            state["q"][i] = adapter.rotate(q, cos, sin)[0, :, QUERY_EVERY - 1::QUERY_EVERY].clone()

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    log = open(CACHE / "capture.log", "a")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    try:
        with torch.no_grad():
            for domain in args.calib_domains.split(","):
                out = CACHE / f"calib_{domain}.pt"
                if out.exists():
                    say(f"{out} exists, skipped")
                    continue
                top = max(c for c in CHECKPOINTS if c <= args.calib_tokens)
                ids = tokens_of(calibration_texts(domain), tok, top).view(-1, SEQ_LEN)
                state.update(mode="calib", counts={"sink": 0, "rest": 0}, moments={
                    kind: {g: {"total": torch.zeros(layers, heads, dim, dtype=torch.float64),
                               "outer": torch.zeros(layers, heads, dim, dim, dtype=torch.float64)}
                           for g in ("sink", "rest")} for kind in KINDS})
                snaps, t0 = {}, time.time()
                for b, batch in enumerate(ids.split(BATCH)):
                    model(input_ids=batch, use_cache=False)
                    seen = (b + 1) * BATCH * SEQ_LEN
                    if seen in CHECKPOINTS:
                        snaps[seen] = {"counts": dict(state["counts"]),
                                       "moments": {k: {g: {n: t.clone() for n, t in d.items()} for g, d in gd.items()}
                                                   for k, gd in state["moments"].items()}}
                        say(f"calib {domain}: {seen} tokens, {time.time() - t0:.0f} s")
                torch.save({"snapshots": snaps, "seq_len": SEQ_LEN, "sinks": SINKS}, out)
            for domain, count in (("verse", args.verse_seqs), ("prose", args.prose_seqs)):
                need = [i for i in range(count) if not (CACHE / f"heldout_{domain}_{i}.pt").exists()]
                if not need:
                    continue
                ids = tokens_of(heldout_texts(domain), tok, count * HELD_LEN).view(count, HELD_LEN)
                for i in need:
                    state.update(mode="held", pre=[None] * layers, val=[None] * layers, q=[None] * layers)
                    t0 = time.time()
                    model(input_ids=ids[i:i + 1], use_cache=False)
                    torch.save({"ids": ids[i], "pre": torch.stack(state["pre"]), "val": torch.stack(state["val"]),
                                "q": torch.stack(state["q"]), "query_every": QUERY_EVERY},
                               CACHE / f"heldout_{domain}_{i}.pt")
                    say(f"held-out {domain} {i}: {HELD_LEN} tokens, {time.time() - t0:.0f} s")
    finally:
        for h in hooks:
            h.remove()
    say("capture done")


# ----- shared helpers ------------------------------------------------------------------------------------------


def pca_of(moments: dict, counts: dict, kind: str, with_sinks: bool):
    """(mean [L, H, d], eigenvalues [L, H, d] descending, eigenvectors [L, H, d, d]) from cached moments."""
    from patchkv.pca import principal_components

    groups = ("sink", "rest") if with_sinks else ("rest",)
    n = sum(counts[g] for g in groups)
    total = sum(moments[kind][g]["total"] for g in groups)
    outer = sum(moments[kind][g]["outer"] for g in groups)
    mean = total / n
    cov = outer / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    L, H, d = mean.shape
    p = principal_components(mean.reshape(L * H, d), cov.reshape(L * H, d, d))
    return p.mean.view(L, H, d), p.eigenvalues.view(L, H, d), p.eigenvectors.view(L, H, d, d)


def calibration(domain: str, tokens: int | None = None):
    snaps = torch.load(CACHE / f"calib_{domain}.pt")["snapshots"]
    tokens = max(snaps) if tokens is None else tokens
    return snaps[tokens]["moments"], snaps[tokens]["counts"], tokens


def heldout(domain: str) -> list[dict]:
    files = sorted(CACHE.glob(f"heldout_{domain}_*.pt"))
    return [torch.load(f) for f in files]


_ROPE: dict = {}


def rope_tables(n: int):
    """cos, sin `[1, n, d]` of SmolLM2 for positions 0..n-1 (from the model's own rotary embedding)."""
    if n not in _ROPE:
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        emb = LlamaRotaryEmbedding(AutoConfig.from_pretrained(MODEL))
        x = torch.zeros(1, 1, n, 64)
        _ROPE[n] = emb(x, torch.arange(n).unsqueeze(0))
    return _ROPE[n]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[heads, n, d]` -> RoPE-rotated, with the adapter's rotate."""
    from patchkv.adapters.base import AttentionAdapter

    return AttentionAdapter.rotate(x.unsqueeze(0), cos, sin)[0]


def reconstruct(x: torch.Tensor, mean: torch.Tensor, vecs: torch.Tensor, rank: int,
                bits: torch.Tensor | None = None, eig: torch.Tensor | None = None) -> torch.Tensor:
    """x `[H, n, d]` through patchkv's LatentBasis (rank components), or its fixed-rate codes when `bits` [H, d]."""
    from patchkv.latent import LatentBasis
    from patchkv.quantize import CoefficientQuantizer

    H = x.shape[0]
    if bits is not None:
        ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in bits]
    else:
        ranks = [rank] * H
    basis = LatentBasis(mean.float(), vecs.float(), ranks, 3, torch.float32)
    coeffs = basis.coefficients(x.unsqueeze(0))
    if bits is not None:
        std = eig[:, : basis.max_rank].double().clamp_min(0).sqrt()
        qz = CoefficientQuantizer(bits[:, : basis.max_rank] * basis.keep, std)
        coeffs = qz.decode(qz.encode(coeffs), torch.float32)
    return basis.reconstruct(coeffs)[0]


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as p

    return p


# ----- figures -------------------------------------------------------------------------------------------------

METHODS1 = (("pca-pre-r16", "pre", 16, None), ("pca-pre-r32", "pre", 32, None), ("pca-post-r16", "post", 16, None),
            ("dp-pre-64bits (16x vs fp16)", "pre", None, 64))


def save(fig, title: str, name: str) -> None:
    """`fig` under its `title`, laid out, to `evals/results/<name>` (110 dpi)."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=110)


def finish_axes(a, xlabel: str, ylabel: str) -> None:
    """Axes `a` labelled, on a grid over major and minor ticks, with a small legend."""
    a.set_xlabel(xlabel)
    a.set_ylabel(ylabel)
    a.grid(alpha=0.3, which="both")
    a.legend(fontsize=7)


def fig1() -> None:
    """Error vs matrix size: per-token error sums on the held-out verse stream, aggregated over the first T tokens."""
    from patchkv.quantize import allocate_bits

    moments, counts, ntok = calibration("verse")
    bases = {kind: pca_of(moments, counts, kind, with_sinks=False) for kind in KINDS}
    seqs = heldout("verse")
    L, H, n, d = seqs[0]["pre"].shape
    cos, sin = rope_tables(n)
    g = torch.Generator().manual_seed(0)
    every = seqs[0]["query_every"]
    j = torch.arange(n)
    m_min = ((j - (every - 1)).clamp_min(0) + every - 1) // every
    nq = n // every
    alloc = {b: {k: allocate_bits(bases[k][1], b) for k in KINDS} for b in {m[3] for m in METHODS1} if b}
    per = {}  # method -> dict of per-token float64 arrays over the whole stream
    pairs = [m_min + (torch.rand(n, generator=g) * (nq - m_min)).long() for _ in seqs]
    for name, kind, rank, bits in METHODS1:
        t0 = time.time()
        acc = {k: [] for k in ("k_err", "k_norm", "v_err", "v_norm", "s_err", "s_ref")}
        for s, seq in enumerate(seqs):
            tok = {k: torch.zeros(n, dtype=torch.float64) for k in acc}
            for layer in range(L):
                pre, val, q = seq["pre"][layer], seq["val"][layer], seq["q"][layer]
                post = rotate(pre, cos, sin)
                mean, eig, vecs = (t[layer] for t in bases[kind])
                kb = alloc[bits][kind][layer] if bits else None
                khat = reconstruct(pre if kind == "pre" else post, mean, vecs, rank, kb, eig)
                if kind == "pre":
                    khat = rotate(khat, cos, sin)
                vmean, veig, vvecs = (t[layer] for t in bases["val"])
                vb = alloc[bits]["val"][layer] if bits else None
                vhat = reconstruct(val, vmean, vvecs, rank, vb, veig)
                diff = khat - post
                tok["k_err"] += diff.double().pow(2).sum((0, 2))
                tok["k_norm"] += post.double().pow(2).sum((0, 2))
                tok["v_err"] += (vhat - val).double().pow(2).sum((0, 2))
                tok["v_norm"] += val.double().pow(2).sum((0, 2))
                qq = q[:, pairs[s]]  # [9, n, d]: each key's query, a later position of its sequence
                tok["s_err"] += (qq * diff.repeat_interleave(3, 0)).sum(-1).abs().sum(0).double() / d ** 0.5
                tok["s_ref"] += (qq * post.repeat_interleave(3, 0)).sum(-1).abs().sum(0).double() / d ** 0.5
            for k in acc:
                acc[k].append(tok[k])
        per[name] = {k: torch.cat(v) for k, v in acc.items()}
        print(f"fig1 {name}: {time.time() - t0:.0f} s", flush=True)
    total_tokens = len(seqs) * n
    per_token = L * H * d
    sizes = [1e6, 3e6, 1e7, 3e7, 1e8, total_tokens * per_token, 3e8, 1e9]
    rows = []
    for size in sorted(set(int(x) for x in sizes)):
        T = max(1, round(size / per_token))
        passes, rest = divmod(T, total_tokens)
        for name, _, _, _ in METHODS1:
            sums = {k: float(passes * v.sum() + v[:rest].sum()) for k, v in per[name].items()}
            pairs_n = T * L * 9
            rows.append({"elements": T * per_token, "tokens": T, "unique_tokens": min(T, total_tokens),
                         "passes_over_data": round(T / total_tokens, 3), "method": name,
                         "key_abs_l2": round(sums["k_err"] ** 0.5, 4), "key_rel_l2": round((sums["k_err"] / sums["k_norm"]) ** 0.5, 5),
                         "value_abs_l2": round(sums["v_err"] ** 0.5, 4),
                         "value_rel_l2": round((sums["v_err"] / sums["v_norm"]) ** 0.5, 5),
                         "key_rms_err_per_element": round((sums["k_err"] / (T * per_token)) ** 0.5, 5),
                         "value_rms_err_per_element": round((sums["v_err"] / (T * per_token)) ** 0.5, 5),
                         "mean_abs_logit_err": round(sums["s_err"] / pairs_n, 5),
                         "mean_abs_logit": round(sums["s_ref"] / pairs_n, 4)})
    write_csv(rows, RESULTS / "research_fig1_error_vs_size.csv")
    p = plt()
    fig, ax = p.subplots(1, 3, figsize=(16, 4.6))
    for i, (name, _, _, _) in enumerate(METHODS1):
        r = [x for x in rows if x["method"] == name]
        e, col = [x["elements"] for x in r], f"C{i}"
        ax[0].loglog(e, [x["key_abs_l2"] for x in r], "o-", color=col, label=f"K {name}")
        ax[0].loglog(e, [x["value_abs_l2"] for x in r], "s--", color=col, label=f"V {name}", alpha=0.7)
        ax[1].semilogx(e, [x["key_rel_l2"] for x in r], "o-", color=col, label=f"K {name}")
        ax[1].semilogx(e, [x["value_rel_l2"] for x in r], "s--", color=col, label=f"V {name}", alpha=0.7)
        ax[2].semilogx(e, [x["mean_abs_logit_err"] for x in r], "o-", color=col, label=name)
    for a in ax:
        a.axvline(total_tokens * per_token, color="grey", lw=0.8, ls=":")
        a.set_xlabel("matrix size (elements of K or V, all layers and KV heads)")
        a.grid(alpha=0.3)
    ax[0].set_ylabel("absolute Frobenius error ||X - X_hat||")
    ax[1].set_ylabel("relative error ||X - X_hat|| / ||X||")
    ax[2].set_ylabel("mean |q.k - q.k_hat| / sqrt(d)")
    ax[1].legend(fontsize=6, ncol=2)
    ax[2].legend(fontsize=7)
    save(fig, f"SmolLM2-135M, held-out Shakespeare ({total_tokens} unique tokens; right of the dotted line the same "
         f"tokens are reused), bases: verse calibration {ntok} tokens, first {SINKS} positions excluded",
         "research_fig1_error_vs_size.png")


def rel_errors(bases, seqs, rank: int, skip: int = 0, post: bool = False) -> dict:
    """Relative L2 error of pre-RoPE keys (== after rotation), optionally post-RoPE keys, and values at `rank`,
    over positions >= skip of the held-out sequences."""
    err = {"keys": [0.0, 0.0], "values": [0.0, 0.0], "keys_post": [0.0, 0.0]}
    for seq in seqs:
        L, H, n, d = seq["pre"].shape
        if post:
            cos, sin = rope_tables(n)
        for layer in range(L):
            items = [("keys", "pre", seq["pre"][layer]), ("values", "val", seq["val"][layer])]
            if post:
                items.append(("keys_post", "post", rotate(seq["pre"][layer], cos, sin)))
            for name, kind, x in items:
                x = x[:, skip:]
                mean, eig, vecs = (t[layer] for t in bases[kind])
                xh = reconstruct(x, mean, vecs, rank)
                err[name][0] += float((xh - x).double().pow(2).sum())
                err[name][1] += float(x.double().pow(2).sum())
    return {k: (v[0] / v[1]) ** 0.5 for k, v in err.items() if v[1]}


def fig2() -> None:
    """Relative error vs number of calibration tokens, in-domain and cross-domain (verse <-> prose), rank 16 of 64."""
    rank = 16
    evals = {"verse": heldout("verse"), "prose": heldout("prose")}
    rows = []
    for cal in ("verse", "prose"):
        snaps = torch.load(CACHE / f"calib_{cal}.pt")["snapshots"]
        for tokens in sorted(snaps):
            moments, counts = snaps[tokens]["moments"], snaps[tokens]["counts"]
            bases = {kind: pca_of(moments, counts, kind, with_sinks=False) for kind in KINDS}
            for ev, seqs in evals.items():
                e = rel_errors(bases, seqs, rank, skip=SINKS, post=True)
                rows.append({"calibrated_on": cal, "evaluated_on": ev, "calibration_tokens": tokens,
                             "statistics_tokens": counts["rest"], "rank": rank,
                             "eval_tokens": sum(s["pre"].shape[2] - SINKS for s in seqs),
                             "keys_pre_rope_rel_l2": round(e["keys"], 5), "keys_post_rope_rel_l2": round(e["keys_post"], 5),
                             "values_rel_l2": round(e["values"], 5)})
                print(rows[-1], flush=True)
    write_csv(rows, RESULTS / "research_fig2_calibration_tokens.csv")
    p = plt()
    fig, ax = p.subplots(1, 3, figsize=(15, 4.5))
    for a, col, title in zip(ax, ("keys_pre_rope_rel_l2", "keys_post_rope_rel_l2", "values_rel_l2"),
                             ("keys, pre-RoPE basis", "keys, post-RoPE basis", "values")):
        for cal, ev, style in (("verse", "verse", "o-"), ("verse", "prose", "o--"), ("prose", "prose", "s-"),
                               ("prose", "verse", "s--")):
            r = [x for x in rows if x["calibrated_on"] == cal and x["evaluated_on"] == ev]
            a.semilogx([x["calibration_tokens"] for x in r], [100 * x[col] for x in r], style,
                       label=f"{cal} -> {ev}" + (" (in-domain)" if cal == ev else " (cross-domain)"))
        a.set_title(f"{title}, rank {rank} of 64")
        a.set_xlabel("calibration tokens")
        a.set_ylabel("relative L2 error (%)")
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    save(fig, "SmolLM2-135M: PCA error on held-out text vs calibration size (first 4 positions of each sequence "
         "out of calibration and evaluation)", "research_fig2_calibration_tokens.png")


def position_bins(n: int) -> list[tuple[int, int]]:
    bins = [(0, 1), (1, 2), (2, 3), (3, 4)]
    lo = 4
    while lo < n:
        bins.append((lo, min(2 * lo, n)))
        lo *= 2
    return bins


def fig3() -> None:
    """Relative error vs context position (0 .. 8191), bases with and without the first 4 positions in calibration."""
    rank = 16
    moments, counts, ntok = calibration("verse")
    tagged = [("verse", s) for s in heldout("verse")] + [("prose", s) for s in heldout("prose")]
    n = tagged[0][1]["pre"].shape[2]
    cos, sin = rope_tables(n)
    bins = position_bins(n)
    rows = []
    for with_sinks in (True, False):
        bases = {kind: pca_of(moments, counts, kind, with_sinks=with_sinks) for kind in KINDS}
        for domain in ("verse", "prose"):
            sub = [s for dom, s in tagged if dom == domain]
            err = {k: torch.zeros(n, dtype=torch.float64) for k in ("keys", "keys_post", "values")}
            norm = {k: torch.zeros(n, dtype=torch.float64) for k in err}
            for seq in sub:
                for layer in range(seq["pre"].shape[0]):
                    pre = seq["pre"][layer]
                    for name, kind, x in (("keys", "pre", pre), ("keys_post", "post", rotate(pre, cos, sin)),
                                          ("values", "val", seq["val"][layer])):
                        mean, eig, vecs = (t[layer] for t in bases[kind])
                        xh = reconstruct(x, mean, vecs, rank)
                        err[name] += (xh - x).double().pow(2).sum((0, 2))
                        norm[name] += x.double().pow(2).sum((0, 2))
            for lo, hi in bins:
                row = {"calibration": f"first {SINKS} included" if with_sinks else f"first {SINKS} excluded",
                       "evaluated_on": domain, "sequences": len(sub), "pos_lo": lo, "pos_hi": hi - 1}
                for name in err:
                    row[f"{name}_rel_l2"] = round(float(err[name][lo:hi].sum() / norm[name][lo:hi].sum()) ** 0.5, 5)
                row["key_head_vector_norm_rms"] = round(float(norm["keys"][lo:hi].sum() / ((hi - lo) * len(sub) * 90)) ** 0.5, 3)
                row["value_head_vector_norm_rms"] = round(float(norm["values"][lo:hi].sum() / ((hi - lo) * len(sub) * 90)) ** 0.5, 3)
                rows.append(row)
            print(f"fig3 sinks={with_sinks} {domain}", flush=True)
    # control: post-RoPE bases from long sequences (all positions 0..8191: held-out verse sequences 0 and 1),
    # evaluated on held-out verse sequence 2 only, to test whether the post-RoPE growth past 512 is the calibration length
    from patchkv.pca import CovarianceAccumulator

    verse = [s for dom, s in tagged if dom == "verse"]
    L = verse[0]["pre"].shape[0]
    accs = [CovarianceAccumulator(3, 64) for _ in range(L)]
    for seq in verse[:2]:
        for layer in range(L):
            x = rotate(seq["pre"][layer], cos, sin)
            accs[layer].add(x[:, SINKS:])
    pcs = [a.pca() for a in accs]
    long_post = (torch.stack([q.mean for q in pcs]), torch.stack([q.eigenvalues for q in pcs]),
                 torch.stack([q.eigenvectors for q in pcs]))
    short = {kind: pca_of(moments, counts, kind, with_sinks=False) for kind in ("pre", "post")}
    err = {k: torch.zeros(n, dtype=torch.float64) for k in ("long", "short", "pre")}
    norm = torch.zeros(n, dtype=torch.float64)
    seq = verse[2]
    for layer in range(L):
        post = rotate(seq["pre"][layer], cos, sin)
        for name, basis, x in (("long", long_post, post), ("short", short["post"], post),
                               ("pre", short["pre"], seq["pre"][layer])):
            mean, eig, vecs = (t[layer] for t in basis)
            err[name] += (reconstruct(x, mean, vecs, rank) - x).double().pow(2).sum((0, 2))
        norm += post.double().pow(2).sum((0, 2))
    control = []
    for lo, hi in bins:
        control.append({"evaluated_on": "held-out verse sequence 2", "pos_lo": lo, "pos_hi": hi - 1, "rank": rank,
                        "keys_post_long_calib_rel_l2": round(float(err["long"][lo:hi].sum() / norm[lo:hi].sum()) ** 0.5, 5),
                        "keys_post_512_calib_rel_l2": round(float(err["short"][lo:hi].sum() / norm[lo:hi].sum()) ** 0.5, 5),
                        "keys_pre_512_calib_rel_l2": round(float(err["pre"][lo:hi].sum() / norm[lo:hi].sum()) ** 0.5, 5)})
    write_csv(control, RESULTS / "research_fig3_post_rope_long_calibration.csv")
    write_csv(rows, RESULTS / "research_fig3_error_vs_position.csv")
    p = plt()
    fig, ax = p.subplots(1, 2, figsize=(13, 4.6))
    centers = [max(0.5, (lo + hi - 1) / 2) if hi - lo > 1 else max(lo, 0.5) for lo, hi in bins]
    for a, kind, title in ((ax[0], "keys", "keys (pre-RoPE basis; post-RoPE dashed-dot)"), (ax[1], "values", "values")):
        for cal, color in ((f"first {SINKS} included", "C0"), (f"first {SINKS} excluded", "C1")):
            for domain, style in (("verse", "o-"), ("prose", "s--")):
                r = [x for x in rows if x["calibration"] == cal and x["evaluated_on"] == domain]
                a.semilogx(centers, [100 * x[f"{kind}_rel_l2"] for x in r], style, color=color,
                           label=f"calib. {cal}, eval {domain}")
                if kind == "keys" and domain == "verse":
                    a.semilogx(centers, [100 * x["keys_post_rel_l2"] for x in r], "-.", color=color, alpha=0.5,
                               label=f"post-RoPE, calib. {cal}, eval verse")
        if kind == "keys":
            a.semilogx(centers, [100 * x["keys_post_long_calib_rel_l2"] for x in control], ":", color="C2",
                       label="post-RoPE, calibrated on 2 x 8192 positions (control), eval verse seq 2")
        a.axvline(SEQ_LEN, color="grey", ls=":", lw=0.8)
        a.text(SEQ_LEN * 1.05, a.get_ylim()[1] * 0.9, "calibration\nseq_len", fontsize=7, color="grey", va="top")
        finish_axes(a, "position in the 8192-token sequence (log bins; position 0 drawn at 0.5)", "relative L2 error (%)")
        a.set_yscale("log")
        a.set_title(f"{title}, rank {rank} of 64")
    save(fig, f"SmolLM2-135M: error by position, bases from {ntok} verse calibration tokens (512-token sequences)",
         "research_fig3_error_vs_position.png")


def fig4() -> None:
    """DP bit allocation per component index: per head (patchkv.quantize) and, if present, one global pool."""
    from patchkv.quantize import MAX_BITS, allocate_bits

    moments, counts, ntok = calibration("verse")
    eig = {"keys": pca_of(moments, counts, "pre", False)[1], "values": pca_of(moments, counts, "val", False)[1]}
    L, H, d = eig["keys"].shape
    bands = {"all layers": range(0, L), "layers 0-9": range(0, 10), "layers 10-19": range(10, 20),
             "layers 20-29": range(20, 30)}
    rows = []
    per_head = {}
    for kind, budget in (("keys", 64), ("keys", 32), ("values", 64), ("values", 32)):
        bits = allocate_bits(eig[kind], budget).double()  # [L, H, d]
        per_head[(kind, budget)] = bits
        for band, layers in bands.items():
            b = bits[list(layers)].reshape(-1, d)
            for c in range(d):
                rows.append({"scheme": "per-head DP (patchkv.quantize.allocate_bits)", "kind": kind,
                             "bits_per_head": budget, "ratio_vs_fp16": 1024 // budget, "band": band, "component": c + 1,
                             "mean_bits": round(float(b[:, c].mean()), 4), "min_bits": int(b[:, c].min()),
                             "max_bits": int(b[:, c].max())})
    global_bits = None
    try:
        from patchkv.allocation import allocate_bits_global
    except ImportError:
        allocate_bits_global = None
    if allocate_bits_global is not None:
        for budget in (64, 32):
            flat = torch.cat([eig["keys"].flatten(), eig["values"].flatten()])
            g = allocate_bits_global(flat, budget * L * H * 2).double()
            gk, gv = g[: L * H * d].view(L, H, d), g[L * H * d:].view(L, H, d)
            global_bits = global_bits or {}
            global_bits[budget] = (gk, gv)
            for kind, bits in (("keys", gk), ("values", gv)):
                for band, layers in bands.items():
                    b = bits[list(layers)].reshape(-1, d)
                    for c in range(d):
                        rows.append({"scheme": "global pool (patchkv.allocation.allocate_bits_global, plain eigenvalues)",
                                     "kind": kind, "bits_per_head": budget, "ratio_vs_fp16": 1024 // budget,
                                     "band": band, "component": c + 1, "mean_bits": round(float(b[:, c].mean()), 4),
                                     "min_bits": int(b[:, c].min()), "max_bits": int(b[:, c].max())})
    write_csv(rows, RESULTS / "research_fig4_bit_allocation.csv")
    p = plt()
    ncol = 3 if global_bits else 2
    fig, ax = p.subplots(1, ncol, figsize=(5.3 * ncol, 4.6))
    x = torch.arange(1, d + 1)
    for (kind, budget), style in zip(per_head, ("o-", "o--", "s-", "s--")):
        b = per_head[(kind, budget)].reshape(-1, d)
        ax[0].semilogx(x, b.mean(0), style, ms=3, label=f"{kind}, {budget} bits/head ({1024 // budget}x)")
    for band, color in (("layers 0-9", "C0"), ("layers 10-19", "C1"), ("layers 20-29", "C2")):
        for kind, style in (("keys", "-"), ("values", "--")):
            b = per_head[(kind, 64)][list(bands[band])].reshape(-1, d)
            ax[1].semilogx(x, b.mean(0), style, color=color, label=f"{kind} 64 bits, {band}")
    ax[0].set_title("per-head DP, mean over 30 layers x 3 KV heads")
    ax[1].set_title("per-head DP at 64 bits (16x), by layer band")
    if global_bits:
        for budget, style in ((64, "-"), (32, "--")):
            gk, gv = global_bits[budget]
            ax[2].semilogx(x, gk.reshape(-1, d).mean(0), "o" + style, ms=3, color="C0",
                           label=f"keys, pool {budget} bits/head avg ({1024 // budget}x)")
            ax[2].semilogx(x, gv.reshape(-1, d).mean(0), "s" + style, ms=3, color="C3",
                           label=f"values, pool {budget} bits/head avg")
        ax[2].set_title("one global pool over layers, heads, K and V\n(plain eigenvalues = raw MSE units)")
    for a in ax:
        finish_axes(a, "principal component index", f"bits (max {MAX_BITS})")
    save(fig, f"SmolLM2-135M: bit allocation from eigenvalues of {ntok} verse calibration tokens (pre-RoPE keys)",
         "research_fig4_bit_allocation.png")


def fig5() -> None:
    """RoPE and PCA: one head's keys on their first two principal directions, pre vs post RoPE, and the spectra."""
    moments, counts, ntok = calibration("verse")
    pre = pca_of(moments, counts, "pre", False)
    post = pca_of(moments, counts, "post", False)
    frac = {k: v[1] / v[1].sum(-1, keepdim=True) for k, v in (("pre", pre), ("post", post))}
    top2 = {k: v[..., :2].sum(-1) for k, v in frac.items()}  # [L, H]
    gap = top2["pre"] - top2["post"]
    layer, head = divmod(int(gap.argmax()), gap.shape[1])
    seq = heldout("verse")[0]
    n = seq["pre"].shape[2]
    cos, sin = rope_tables(n)
    k_pre = seq["pre"][layer]
    k_post = rotate(k_pre, cos, sin)
    rows = []
    for L_ in range(gap.shape[0]):
        for h in range(gap.shape[1]):
            rows.append({"layer": L_, "kv_head": h, "pre_pc1": round(float(frac["pre"][L_, h, 0]), 4),
                         "pre_pc2": round(float(frac["pre"][L_, h, 1]), 4),
                         "post_pc1": round(float(frac["post"][L_, h, 0]), 4),
                         "post_pc2": round(float(frac["post"][L_, h, 1]), 4),
                         "pre_rank16_energy": round(float(frac["pre"][L_, h, :16].sum()), 4),
                         "post_rank16_energy": round(float(frac["post"][L_, h, :16].sum()), 4),
                         "chosen": int(L_ == layer and h == head)})
    write_csv(rows, RESULTS / "research_fig5_rope_pca.csv")
    cum = [{"component": c + 1, "pre_rope_cum": round(float(frac["pre"][layer, head, : c + 1].sum()), 5),
            "post_rope_cum": round(float(frac["post"][layer, head, : c + 1].sum()), 5),
            "pre_rope_cum_mean_all_heads": round(float(frac["pre"][..., : c + 1].sum(-1).mean()), 5),
            "post_rope_cum_mean_all_heads": round(float(frac["post"][..., : c + 1].sum(-1).mean()), 5)}
           for c in range(frac["pre"].shape[-1])]
    write_csv(cum, RESULTS / "research_fig5_rope_cumulative.csv")
    p = plt()
    fig, ax = p.subplots(1, 3, figsize=(16, 4.8))
    pos = torch.arange(n).float()
    for a, (name, basis, x) in zip(ax[:2], (("pre-RoPE", pre, k_pre), ("post-RoPE", post, k_post))):
        mean, eig, vecs = basis[0][layer, head].float(), basis[1][layer, head], basis[2][layer, head].float()
        z = (x[head] - mean) @ vecs[:, :2]
        f = eig / eig.sum()
        sc = a.scatter(z[:, 0], z[:, 1], c=pos, s=2, cmap="viridis", alpha=0.6)
        a.set_xlabel(f"PC1 ({100 * float(f[0]):.1f}% of variance)")
        a.set_ylabel(f"PC2 ({100 * float(f[1]):.1f}% of variance)")
        a.set_title(f"{name} keys, layer {layer} KV head {head}\n({n} held-out tokens, colour = position)")
        a.set_aspect("equal", "datalim")
        a.grid(alpha=0.3)
    fig.colorbar(sc, ax=ax[1], label="position")
    c = [r["component"] for r in cum]
    ax[2].semilogx(c, [r["pre_rope_cum"] for r in cum], "o-", ms=3, label=f"pre-RoPE, L{layer} H{head}")
    ax[2].semilogx(c, [r["post_rope_cum"] for r in cum], "s-", ms=3, label=f"post-RoPE, L{layer} H{head}")
    ax[2].semilogx(c, [r["pre_rope_cum_mean_all_heads"] for r in cum], "--", color="C0", label="pre-RoPE, mean of 90 heads")
    ax[2].semilogx(c, [r["post_rope_cum_mean_all_heads"] for r in cum], "--", color="C1", label="post-RoPE, mean of 90 heads")
    ax[2].axvline(16, color="grey", ls=":", lw=0.8)
    ax[2].set_xlabel("number of principal components")
    ax[2].set_ylabel("cumulative explained variance")
    ax[2].set_title("explained variance (verse calibration)")
    ax[2].grid(alpha=0.3, which="both")
    ax[2].legend(fontsize=8)
    save(fig, f"SmolLM2-135M: the head where RoPE costs the first two PCs most (top-2 share "
         f"{100 * float(top2['pre'][layer, head]):.0f}% pre vs {100 * float(top2['post'][layer, head]):.0f}% post); "
         f"bases from {ntok} verse tokens", "research_fig5_rope_pca.png")



def main(argv: list[str] | None = None) -> None:
    p = parser("figures", __doc__, out=None)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--calib-domains", default="verse,prose")
    c.add_argument("--calib-tokens", type=int, default=65536)
    c.add_argument("--verse-seqs", type=int, default=3)
    c.add_argument("--prose-seqs", type=int, default=1)
    for name in ("fig1", "fig2", "fig3", "fig4", "fig5"):
        sub.add_parser(name)
    args = parse(p, argv)
    if args.cmd == "capture":
        capture(args)
    else:
        globals()[args.cmd]()


if __name__ == "__main__":
    main()
