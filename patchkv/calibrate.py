"""Calibration: stream text through the model, collect per-head K/V moments with hooks, run PCA."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .adapters import adapter_for, attention_modules
from .artifact import MODES, Artifact, Components, model_identity
from .pca import CovarianceAccumulator, select_ranks

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids [batch, seq], attention_mask [batch, seq]


def calibrate(
    model: nn.Module,
    texts_or_dataloader: str | Iterable[str] | torch.Tensor | Iterable[Any],
    *,
    mode: str = "pre_rope",
    rank: int | None = None,
    energy: float | None = None,
    max_tokens: int = 65_536,
    sink_tokens: int = 0,
    tokenizer: Any = None,
    seq_len: int = 512,
    batch_size: int = 4,
    source: str | None = None,
    progress: bool = True,
) -> Artifact:
    """Calibrate PCA bases for `model`'s keys and values and return them as an `Artifact`.

    texts_or_dataloader: a string or list of strings (needs `tokenizer`; concatenated and cut into
        `seq_len`-token sequences), a `[n, seq]` tensor of token ids, or an iterable of batches
        (dicts with `input_ids` and optionally `attention_mask`, or id tensors).
    mode: "pre_rope" (keys before rotary embedding) or "post_rope" (rotated keys).
    rank / energy: exactly one; per-head ranks are a fixed count, or the fewest components that
        explain `energy` of the variance. Change later without recalibrating: `artifact.with_ranks`.
    max_tokens: stop after this many tokens have contributed statistics.
    sink_tokens: leave the first `sink_tokens` positions of every sequence out of the statistics
        (attention sinks have outlying keys and would skew the bases).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    dim, heads = modules[0].head_dim, modules[0].config.num_key_value_heads
    select_ranks(torch.ones(dim), rank, energy)  # validate the budget before spending time on data
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}.")

    stats = {kind: [CovarianceAccumulator(heads, dim) for _ in modules] for kind in ("keys", "values")}
    token_mask: list[torch.Tensor] = []  # the current batch's [batch, seq] mask of tokens to count

    def collect(attn: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _, k, v = adapter.project_qkv(attn, hidden)
        if mode == "post_rope":
            cos, sin = kwargs["position_embeddings"]
            k = adapter.rotate(k, cos, sin)
        keep = token_mask[0].to(k.device)
        for kind, x in (("keys", k), ("values", v)):
            # [batch, heads, seq, dim] -> [heads, n, dim] over the kept tokens
            stats[kind][attn.layer_idx].add(x.transpose(0, 1)[:, keep])

    hooks = [m.register_forward_pre_hook(collect, with_kwargs=True) for m in modules]
    seen = sequences = 0
    bar = tqdm(total=max_tokens, desc="patchkv calibrate", unit="tok", disable=not progress)
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            for input_ids, attention_mask in _batches(texts_or_dataloader, tokenizer, seq_len, batch_size):
                # real tokens past each row's first sink_tokens (left padding does not count as a position)
                keep = attention_mask.bool() & (attention_mask.cumsum(1) > sink_tokens)
                over = int(keep.sum()) - (max_tokens - seen)
                if over > 0:  # drop the surplus from the end so exactly max_tokens are counted
                    flat = keep.flatten()
                    flat[flat.nonzero().squeeze(1)[-over:]] = False
                    keep = flat.view_as(keep)
                token_mask[:] = [keep]
                model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
                counted = int(keep.sum())
                seen, sequences = seen + counted, sequences + int(keep.any(1).sum())
                bar.update(counted)
                if seen >= max_tokens:
                    break
    finally:
        for h in hooks:
            h.remove()
        bar.close()
        model.train(was_training)
    if seen < 2:
        raise ValueError("Calibration saw fewer than 2 tokens; pass more text (or a smaller sink_tokens).")

    parts = {}
    for kind, accs in stats.items():
        pcas = [acc.pca() for acc in accs]
        eigenvalues = torch.stack([p.eigenvalues for p in pcas])
        parts[kind] = Components(
            mean=torch.stack([p.mean for p in pcas]),
            eigenvalues=eigenvalues,
            eigenvectors=torch.stack([p.eigenvectors for p in pcas]),
            ranks=select_ranks(eigenvalues, rank, energy),
        )
    calibration = {"source": source or _describe(texts_or_dataloader), "tokens": seen, "sequences": sequences,
                   "seq_len": seq_len, "sink_tokens": sink_tokens, "rank_selection": {"rank": rank, "energy": energy}}
    return Artifact(mode=mode, model=model_identity(model), calibration=calibration, **parts)


def _batches(data: Any, tokenizer: Any, seq_len: int, batch_size: int) -> Iterator[Batch]:
    if isinstance(data, str) or (isinstance(data, (list, tuple)) and data and isinstance(data[0], str)):
        if tokenizer is None:
            raise ValueError("Calibrating on text needs a tokenizer: calibrate(model, texts, tokenizer=tokenizer).")
        yield from _text_batches([data] if isinstance(data, str) else data, tokenizer, seq_len, batch_size)
        return
    if isinstance(data, torch.Tensor):
        data = data.unsqueeze(0) if data.dim() == 1 else data
        for start in range(0, data.shape[0], batch_size):
            chunk = data[start:start + batch_size]
            yield chunk, torch.ones_like(chunk)
        return
    for batch in data:
        if isinstance(batch, dict):
            ids = torch.as_tensor(batch["input_ids"])
            mask = torch.as_tensor(batch["attention_mask"]) if "attention_mask" in batch else torch.ones_like(ids)
        else:
            ids = torch.as_tensor(batch)
            mask = torch.ones_like(ids)
        if ids.dim() == 1:
            ids, mask = ids.unsqueeze(0), mask.unsqueeze(0)
        yield ids, mask


def _text_batches(texts: Iterable[str], tokenizer: Any, seq_len: int, batch_size: int) -> Iterator[Batch]:
    """Tokenize text by text (lazily: calibration stops at max_tokens) into full `seq_len` windows."""
    buffer: list[int] = []
    rows: list[list[int]] = []
    produced = False
    for text in texts:
        buffer += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(buffer) >= seq_len:
            rows.append(buffer[:seq_len])
            buffer = buffer[seq_len:]
            if len(rows) == batch_size:
                ids, rows, produced = torch.tensor(rows), [], True
                yield ids, torch.ones_like(ids)
    if rows:
        ids = torch.tensor(rows)
        yield ids, torch.ones_like(ids)
    elif not produced:
        raise ValueError(f"The text has {len(buffer)} tokens, fewer than seq_len={seq_len}; pass more text or a "
                         "smaller seq_len.")


def _describe(data: Any) -> str:
    if isinstance(data, str):
        return f"text ({len(data)} characters)"
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], str):
        return f"{len(data)} texts"
    return type(data).__name__
