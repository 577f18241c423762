"""Calibration: stream text through the model, collect per-head K/V moments with hooks, run PCA.

Under `torchrun` / `accelerate launch` (an initialized process group of more than one process) every rank
iterates the same data, runs the forward passes of its share of the batches (batch `b` on rank
`b % world_size`) and the float64 moments are summed across ranks before the PCA (`patchkv.distributed`).
Token accounting (`max_tokens`, sinks, padding) is done on the whole stream by every rank, so all ranks stop
at the same batch, count the same tokens and return the same `Artifact` as a single process on that data.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .adapters import adapter_for, attention_modules
from .artifact import Artifact, Components
from .artifact_format import MODES, layer_groups
from .compat import accelerate_hook, execution_device
from .distributed import World, all_gather, all_reduce_sum, world
from .errors import PatchKVError
from .fisher import FisherCapture, effect_weights
from .identity import model_identity
from .pca import CovarianceAccumulator, select_ranks
from .retrieval import measure, source_text, with_retrieval_weights

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids [batch, seq], attention_mask [batch, seq]


def calibrate(
    model: nn.Module,
    texts_or_dataloader: str | Iterable[str] | torch.Tensor | Mapping | Iterable[Any],
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
    fisher_tokens: int = 0,
    fisher_window: int = 32,
    layer_bases: bool = False,
    layers_per_basis: int = 1,
    retrieval_rows: int = 0,
    retrieval_seq: int = 2048,
) -> Artifact:
    """Calibrate PCA bases for `model`'s keys and values and return them as an `Artifact`.

    texts_or_dataloader: one of
        - a string or list of strings (needs `tokenizer`; concatenated and cut into `seq_len`-token sequences);
        - token ids: a `[n, seq]` tensor / array (split into batches of `batch_size` rows);
        - a batch mapping such as a tokenizer's `BatchEncoding` (`tok(texts, return_tensors="pt",
          padding=True)`) or a dict with `input_ids` and optionally `attention_mask` (split into batches of
          `batch_size` rows);
        - an iterable of batches (a list, a generator, a `torch.utils.data.DataLoader`) yielding such mappings
          or id tensors, each used as one batch.
        Padded positions (`attention_mask == 0`, left or right) never enter the statistics, and real tokens get
        positions counted from each row's first real token.
    mode: "pre_rope" (keys before rotary embedding) or "post_rope" (rotated keys).
    rank / energy: exactly one; per-head ranks are a fixed count, or the fewest components that
        explain `energy` of the variance. Change later without recalibrating: `artifact.with_ranks`.
    max_tokens: stop after this many tokens (over all processes) have contributed statistics.
    sink_tokens: leave the first `sink_tokens` real tokens of every sequence out of the statistics
        (attention sinks have outlying keys and would skew the bases).
    fisher_tokens: also measure effect weights (`patchkv.fisher`, artifact format version 2) on the first
        `fisher_tokens` counted tokens: one backward pass per sequence, about three forwards' time, so 8192
        tokens add little to a 65k-token calibration. 0 (the default) skips them; `Quantized(pool="global")`
        needs them.
    fisher_window: while measuring effect weights, the `window` most recent tokens of each query (and the
        sinks) are read exact, as `SinksWindow(sink_tokens, window)` serves them; match it to the window you
        will apply.
    layer_bases: also compute one PCA per layer over its KV heads concatenated (`kv_heads * head_dim` dims,
        artifact format version 5), the basis `Quantized(basis="layer")` codes on: a token's code for a layer is
        then one latent that every head reads, which captures what the heads share. Costs a `[D, D]` moment per
        layer (D = kv_heads * head_dim) and `2 * layers * D * D` floats in the file (8.8 MB for SmolLM2, 268 MB
        for an 8-KV-head model of head_dim 128 and 32 layers).
    layers_per_basis: with `layer_bases`, how many layers each basis spans, consecutive layers of one attention kind
        (it must divide the number of layers of each kind: full attention, each sliding window): 1 (the default) one
        per layer; S > 1 one PCA per span of S layers over their heads concatenated
        (`S * D` dims, artifact format version 7), with effect weights from the span's whole Fisher matrix, cross-layer
        terms included (KVTC's bases across layers). The file holds `2 * layers * S * D * D` floats (44 MB for SmolLM2
        at S = 5).
    retrieval_rows: also measure effect weights on this many retrieval rows of `retrieval_seq` tokens each
        (`patchkv.retrieval`: the calibration text with a number hidden in it and asked for after it, the answer's
        loss alone) and mix them with the text's at equal say, so the bit pool also keeps what retrieval reads. One
        backward per row (on SmolLM2 on 2 CPU cores, about 30 s a row of 2,048 tokens). Needs `fisher_tokens` and the
        data as text (a string or list of strings, with `tokenizer`), at least `8 * retrieval_seq` characters.

    In a process group of several processes, pass the same (unsharded) data on every rank; see the module
    docstring.
    """
    _check_options(mode=mode, max_tokens=max_tokens, sink_tokens=sink_tokens, seq_len=seq_len,
                   batch_size=batch_size, fisher_tokens=fisher_tokens, fisher_window=fisher_window,
                   retrieval_rows=retrieval_rows, retrieval_seq=retrieval_seq, layers_per_basis=layers_per_basis)
    text = _retrieval_text(texts_or_dataloader, tokenizer, retrieval_rows, retrieval_seq)
    _check_not_patched(model)
    _check_retrieval_seq(model, retrieval_rows, retrieval_seq)
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    dim, heads = modules[0].head_dim, modules[0].config.num_key_value_heads
    select_ranks(torch.ones(dim), rank, energy)  # validate the budget before spending time on data
    here = world()
    _check_unsharded(texts_or_dataloader, here)

    span = layers_per_basis if layer_bases else 0
    groups = layer_groups([adapter.sliding_window(m) for m in modules], span) if span else []  # refuses a bad span
    group_of = {layer: (g, layers) for g, layers in enumerate(groups) for layer in layers}
    stats = {kind: [CovarianceAccumulator(heads, dim) for _ in modules] for kind in ("keys", "values")}
    layer_stats = {kind: [CovarianceAccumulator(1, span * heads * dim) for _ in groups] for kind in ("keys", "values")}
    spanned: dict[str, dict[int, list[torch.Tensor]]] = {"keys": {}, "values": {}}  # each span's layers so far:
    # [n, heads * dim] each
    token_mask: list[torch.Tensor] = []  # the current batch's [batch, seq] mask of tokens to count

    def collect(attn: nn.Module, args: tuple, kwargs: dict) -> None:
        # accelerate (device_map with offload) moves inputs and loads weights of a hooked module inside its
        # forward, which runs after this pre-hook: do the same here (the projections' own hooks do the rest)
        hook = accelerate_hook(attn)
        if hook is not None:
            args, kwargs = hook.pre_forward(attn, *args, **kwargs)
        try:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            with torch.no_grad():
                _, k, v = adapter.project_qkv(attn, hidden)
            if mode == "post_rope":
                cos, sin = kwargs["position_embeddings"]
                k = adapter.rotate(k, cos.to(k.device), sin.to(k.device))
            with torch.profiler.record_function("patchkv::moments"):
                for kind, x in (("keys", k), ("values", v)):
                    # [batch, heads, seq, dim] -> [heads, n, dim] over the kept tokens
                    stats[kind][attn.layer_idx].add(x.transpose(0, 1)[:, token_mask[0].to(x.device)])
                    if span:  # [batch, heads, seq, dim] -> [n, heads * dim]: the heads concatenated
                        kept = x.transpose(1, 2)[token_mask[0].to(x.device)]
                        group, layers = group_of[attn.layer_idx]
                        parts = spanned[kind].setdefault(group, [])
                        parts.append(kept.reshape(kept.shape[0], -1))
                        if attn.layer_idx == layers[-1]:  # the span's last layer: its layers concatenated (its device)
                            layer_stats[kind][group].add(torch.cat([p.to(x.device) for p in parts], 1).unsqueeze(0))
                            parts.clear()
        finally:
            if hook is not None:
                hook.post_forward(attn, None)

    hooks = [m.register_forward_pre_hook(collect, with_kwargs=True) for m in modules]
    fisher = FisherCapture(model, adapter, modules, mode=mode, sink_tokens=sink_tokens, window=fisher_window,
                           layers=span) \
        if fisher_tokens else None
    capturing = fisher or contextlib.nullcontext()
    seen = sequences = 0
    fingerprint = hashlib.blake2b(digest_size=8)  # of the stream every rank iterated, compared at the end
    bar = tqdm(total=max_tokens, desc="patchkv calibrate", unit="tok", disable=not progress or here.rank != 0)
    was_training = model.training
    device = _input_device(model)
    model.eval()
    try:
        with torch.no_grad(), capturing:
            batches = _batches(texts_or_dataloader, tokenizer, seq_len, batch_size)
            for index, (input_ids, attention_mask) in enumerate(batches):
                keep = _counted_tokens(attention_mask, sink_tokens, max_tokens - seen)
                counted = int(keep.sum())
                # positions count from each row's first real token (as generate() does for left padding)
                positions = (attention_mask.cumsum(1) - 1).clamp_min(0)
                if here.owns(index) and counted and seen < fisher_tokens:
                    for row in range(input_ids.shape[0]):  # one row at a time: the backward keeps [seq, seq] scores
                        token_mask[:] = [keep[row:row + 1]]
                        one = slice(row, row + 1)
                        fisher.step(input_ids[one], attention_mask[one], positions[one], keep[one], device)
                elif here.owns(index) and counted:
                    token_mask[:] = [keep]
                    model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                          position_ids=positions.to(device), use_cache=False)
                if here.distributed:
                    fingerprint.update(input_ids.numpy().tobytes() + keep.numpy().tobytes())
                seen, sequences = seen + counted, sequences + int(keep.any(1).sum())
                bar.update(counted)
                if seen >= max_tokens:
                    break
    finally:
        for h in hooks:
            h.remove()
        bar.close()
        model.train(was_training)
    if here.distributed:
        _check_same_stream(fingerprint, seen, here)
        _sum_over_ranks([acc for part in (stats, layer_stats) for accs in part.values() for acc in accs])
        if fisher_tokens:
            _sum_fisher_over_ranks(fisher)
    if seen < 2:
        raise ValueError("Calibration saw fewer than 2 tokens; pass more text (or a smaller sink_tokens).")
    retrieval = _retrieval_fisher(model, adapter, modules, text, tokenizer, rows=retrieval_rows, seq=retrieval_seq,
                                  mode=mode, sink_tokens=sink_tokens, window=fisher_window, layers=span,
                                  here=here, device=device, progress=progress and here.rank == 0) \
        if retrieval_rows else None

    parts = {}
    for kind, accs in stats.items():
        with torch.profiler.record_function("patchkv::pca"):
            pcas = [acc.pca() for acc in accs]
        eigenvalues = torch.stack([p.eigenvalues for p in pcas])
        eigenvectors = torch.stack([p.eigenvectors for p in pcas])
        weights = None
        if fisher_tokens:
            weights = effect_weights(getattr(fisher, kind) / max(fisher.count, 1), eigenvectors)
        layer = {}
        if layer_bases:
            with torch.profiler.record_function("patchkv::pca"):
                per_layer = [acc.pca() for acc in layer_stats[kind]]
            layer = {"layer_mean": torch.stack([p.mean[0] for p in per_layer]),
                     "layer_eigenvalues": torch.stack([p.eigenvalues[0] for p in per_layer]),
                     "layer_eigenvectors": torch.stack([p.eigenvectors[0] for p in per_layer])}
            if fisher_tokens:
                layer["layer_weights"] = effect_weights(getattr(fisher, f"layer_{kind}") / max(fisher.count, 1),
                                                        layer["layer_eigenvectors"])
        parts[kind] = Components(
            mean=torch.stack([p.mean for p in pcas]),
            eigenvalues=eigenvalues,
            eigenvectors=eigenvectors,
            ranks=select_ranks(eigenvalues, rank, energy),
            weights=weights,
            **layer,
        )
    if retrieval is not None:
        parts = with_retrieval_weights(parts, retrieval.sums())
    selection = {"rank": None if rank is None else int(rank), "energy": None if energy is None else float(energy)}
    calibration = {"source": source or _describe(texts_or_dataloader), "tokens": seen, "sequences": sequences,
                   "seq_len": int(seq_len), "sink_tokens": int(sink_tokens), "rank_selection": selection}
    if layer_bases:
        calibration["layer_bases"] = True if span == 1 else {"layers_per_basis": span}
    if fisher_tokens:
        calibration["effect_weights"] = {"tokens": fisher.count, "window": int(fisher_window),
                                         "sink_tokens": int(sink_tokens)}
    if retrieval_rows:
        calibration["effect_weights"]["retrieval"] = {"rows": int(retrieval_rows), "seq": int(retrieval_seq),
                                                      "tokens": retrieval.count, "share": 0.5}
    return Artifact(mode=mode, model=model_identity(model), calibration=calibration, **parts)


# ----- validation ---------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_options(*, mode: str, max_tokens: Any, sink_tokens: Any, seq_len: Any, batch_size: Any,
                   fisher_tokens: Any, fisher_window: Any, retrieval_rows: Any = 0, retrieval_seq: Any = 2048,
                   layers_per_basis: Any = 1) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    for name, value, low, hint in (
        ("sink_tokens", sink_tokens, 0, "0 keeps every token; 4 leaves the usual attention sinks out"),
        ("seq_len", seq_len, 1, "the length of the sequences cut from text, e.g. 512"),
        ("batch_size", batch_size, 1, "sequences per forward pass, e.g. 4"),
        ("max_tokens", max_tokens, 1, "the number of tokens to collect statistics on, e.g. 65536"),
        ("fisher_tokens", fisher_tokens, 0, "0 skips effect weights; 8192 measures them"),
        ("fisher_window", fisher_window, 0, "the recent window SinksWindow keeps exact, e.g. 32"),
        ("retrieval_rows", retrieval_rows, 0, "0 skips retrieval rows; 16 measures them"),
        ("retrieval_seq", retrieval_seq, 1, "tokens per retrieval row, e.g. 2048"),
        ("layers_per_basis", layers_per_basis, 1, "1 for one layer basis per layer, 5 for one per 5 layers"),
    ):
        if not _is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r} ({type(value).__name__}); "
                             f"pass {name}=<int> ({hint}).")
    if retrieval_rows and not fisher_tokens:
        raise ValueError(f"retrieval_rows={retrieval_rows} mixes retrieval rows' effect weights with the text's, and "
                         "fisher_tokens=0 measures none: pass fisher_tokens (e.g. 8192) or retrieval_rows=0.")


def _check_not_patched(model: nn.Module) -> None:
    from .patching import is_patched

    if is_patched(model):
        raise PatchKVError(
            "calibrate() needs the original model, but this model is patched by patchkv: its attention would "
            "collect statistics of compressed keys and values. Call patchkv.remove(model) first, then calibrate."
        )


def _check_unsharded(data: Any, here: World) -> None:
    if not here.distributed:
        return
    from torch.utils.data import DataLoader, DistributedSampler

    if isinstance(data, DataLoader):
        samplers = [data.sampler, getattr(data.batch_sampler, "sampler", None)]
        if any(isinstance(s, DistributedSampler) for s in samplers):
            raise ValueError(
                f"calibrate() shards the data across the {here.size} processes itself (batch b on rank "
                "b % world_size) and needs every rank to pass the same, whole data; this DataLoader uses a "
                "DistributedSampler, which would shard it twice. Pass a DataLoader without it."
            )


def _check_same_stream(fingerprint: Any, seen: int, here: World) -> None:
    mine = torch.tensor([int.from_bytes(fingerprint.digest(), "little", signed=True), seen], dtype=torch.int64)
    everyone = all_gather(mine)
    if not bool((everyone == mine).all()):
        raise PatchKVError(
            f"The {here.size} calibration processes iterated different data (token counts by rank: "
            f"{everyone[:, 1].tolist()}). Every rank must pass the same data in the same order (calibrate() "
            "shards it itself): use a fixed seed or shuffle=False, and no DistributedSampler."
        )


def _sum_fisher_over_ranks(fisher: FisherCapture) -> None:
    """Sum a capture's Fisher matrices (`[layers, kv_heads, d, d]`, and `[layers, D, D]` where it has layer ones) and
    its token count over all ranks, in one all-reduce."""
    names = [n for n in ("keys", "values", "layer_keys", "layer_values") if getattr(fisher, n) is not None]
    parts = [getattr(fisher, n) for n in names] + [torch.tensor([float(fisher.count)], dtype=torch.float64)]
    total = all_reduce_sum(torch.cat([p.flatten() for p in parts]))
    *sums, count = total.split([p.numel() for p in parts])
    for name, part, summed in zip(names, parts, sums):
        setattr(fisher, name, summed.view_as(part))
    fisher.count = int(count.item())


def _sum_over_ranks(accumulators: list[CovarianceAccumulator]) -> None:
    """Sum every accumulator's moments over all ranks, in one all-reduce."""
    vectors = [acc.moments() for acc in accumulators]
    total = all_reduce_sum(torch.cat(vectors))
    for acc, part in zip(accumulators, total.split([v.numel() for v in vectors])):
        acc.load_moments(part)


# ----- retrieval rows -------------------------------------------------------------------------------------


def _retrieval_text(data: Any, tokenizer: Any, rows: int, seq: int) -> str | None:
    """The text retrieval rows are cut from (the calibration texts joined by blank lines), checked before any
    forward; None without rows."""
    if not rows:
        return None
    if not (isinstance(data, str) or _is_texts(data)) or tokenizer is None:
        missing = "" if tokenizer is not None else " without a tokenizer"
        raise ValueError("retrieval_rows needs the calibration data as text (a string or a list of strings) and its "
                         f"tokenizer, got {type(data).__name__}{missing}: pass texts and tokenizer=..., or "
                         "retrieval_rows=0.")
    return source_text(data, seq)


def _check_retrieval_seq(model: nn.Module, rows: int, seq: int) -> None:
    """Refuse retrieval rows longer than the positions the model was trained on (`max_position_embeddings`)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if rows and limit and seq > limit:
        raise ValueError(f"retrieval_seq={seq} is longer than the {limit} positions this model was trained on "
                         f"(max_position_embeddings); pass retrieval_seq <= {limit}.")


def _retrieval_fisher(model: nn.Module, adapter: Any, modules: list[nn.Module], text: str, tokenizer: Any, *,
                      rows: int, seq: int, mode: str, sink_tokens: int, window: int, layers: int, here: World,
                      device: torch.device, progress: bool) -> FisherCapture:
    """The Fisher of the answers' loss over `rows` seeded retrieval rows of `text` (`patchkv.retrieval.measure`); row
    r on rank r % world_size, summed over ranks."""
    fisher = FisherCapture(model, adapter, modules, mode=mode, sink_tokens=sink_tokens, window=window, layers=layers)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), fisher:
            mine = [row for row in range(rows) if here.owns(row)]
            measure(fisher, tokenizer, text, tqdm(mine, desc="patchkv retrieval rows", unit="row",
                                                  disable=not progress), seq, device)
    finally:
        model.train(was_training)
    if here.distributed:
        _sum_fisher_over_ranks(fisher)
    return fisher


# ----- token accounting -----------------------------------------------------------------------------------


def _counted_tokens(attention_mask: torch.Tensor, sink_tokens: int, budget: int) -> torch.Tensor:
    """`[batch, seq]` bool: real tokens past each row's first `sink_tokens` real tokens (padding, left or right,
    is not a position), of which at most `budget`, the first in row-major order."""
    keep = attention_mask.bool() & (attention_mask.cumsum(1) > sink_tokens)
    over = int(keep.sum()) - budget
    if over > 0:  # drop the surplus from the end so exactly max_tokens are counted
        flat = keep.flatten()
        flat[flat.nonzero().squeeze(1)[-over:]] = False
        keep = flat.view_as(keep)
    return keep


def _input_device(model: nn.Module) -> torch.device:
    """Where input ids go: the embedding's device, or its accelerate execution device when it is offloaded."""
    embeddings = model.get_input_embeddings()
    execution = execution_device(embeddings)
    if execution is not None:
        return execution
    weight = next(embeddings.parameters(), None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return torch.device("cpu")


# ----- inputs ---------------------------------------------------------------------------------------------


def _is_texts(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and isinstance(data[0], str)


def _batches(data: Any, tokenizer: Any, seq_len: int, batch_size: int) -> Iterator[Batch]:
    if not isinstance(data, (str, list, tuple, Mapping, torch.Tensor, np.ndarray)) and isinstance(data, Iterable):
        # a generator or a DataLoader: look at the first item to tell texts from batches
        data = iter(data)
        first = next(data, None)
        if first is None:
            return
        data = itertools.chain([first], data)
        if isinstance(first, str):
            data = list(data)
    if isinstance(data, str) or _is_texts(data):
        if tokenizer is None:
            raise ValueError("Calibrating on text needs a tokenizer: calibrate(model, texts, tokenizer=tokenizer).")
        yield from text_batches([data] if isinstance(data, str) else data, tokenizer, seq_len, batch_size)
        return
    if isinstance(data, (Mapping, torch.Tensor, np.ndarray)):  # one block of rows: cut into batches
        ids, mask = _as_batch(data)
        for start in range(0, ids.shape[0], batch_size):
            yield ids[start:start + batch_size], mask[start:start + batch_size]
        return
    if not isinstance(data, Iterable):
        raise TypeError(_INPUT_HELP.format(found=type(data).__name__))
    for batch in data:
        yield _as_batch(batch)


_INPUT_HELP = ("calibrate() takes text (a string or list of strings, with tokenizer=), token ids (a [n, seq] tensor), a "
               "batch mapping with 'input_ids' and optionally 'attention_mask' (e.g. tokenizer(texts, "
               "return_tensors='pt', padding=True)), or an iterable / DataLoader of such batches; found {found}.")


def _as_batch(batch: Any) -> Batch:
    """One batch as `[batch, seq]` int64 ids and a 0/1 mask (rows of different lengths are right-padded)."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise TypeError(f"A calibration batch given as a mapping needs an 'input_ids' entry; found keys "
                            f"{list(batch)}. " + _INPUT_HELP.format(found=type(batch).__name__))
        ids, real = _as_rows(batch["input_ids"], "input_ids")
        given = batch.get("attention_mask")
        mask = real.long() if given is None else _as_rows(given, "attention_mask")[0]
    elif isinstance(batch, str) or batch is None:
        raise TypeError(_INPUT_HELP.format(found=f"a batch of type {type(batch).__name__}"))
    else:
        ids, real = _as_rows(batch, "input_ids")
        mask = real.long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {tuple(ids.shape)}; "
                         "they must match (one 0/1 entry per token).")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token), found other values; pass "
                         "the 2-D padding mask a tokenizer returns, not a 4-D or additive mask.")
    return ids, mask * real.long()


def _as_rows(x: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`[batch, seq]` int64 tensor from a tensor, array or (possibly ragged) nested list, and the bool mask of
    its entries that were given (False where ragged rows were padded with 0)."""
    if isinstance(x, (list, tuple)) and x and not isinstance(x[0], numbers.Number) and len({len(r) for r in x}) > 1:
        length = max(len(r) for r in x)
        real = torch.tensor([[True] * len(r) + [False] * (length - len(r)) for r in x])
        x = [list(map(int, r)) + [0] * (length - len(r)) for r in x]
    else:
        real = None
    try:
        t = torch.stack(list(x)) if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor) else \
            torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must be token ids (a tensor, array or nested list of ints), got "
                        f"{type(x).__name__}: {e}. " + _INPUT_HELP.format(found=type(x).__name__)) from None
    if t.dtype == torch.bool:
        t = t.long()
    if t.is_complex() or (t.is_floating_point() and (name == "input_ids" or not bool((t == t.round()).all()))):
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}.")
    t = t.long().cpu()
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq] (or one [seq] sequence), got shape {tuple(t.shape)}.")
    return t, torch.ones_like(t, dtype=torch.bool) if real is None else real.view_as(t)


def text_batches(texts: Iterable[str], tokenizer: Any, seq_len: int, batch_size: int) -> Iterator[Batch]:
    """Tokenize text by text (lazily: calibration stops at max_tokens) into full `seq_len` windows: batches of
    `batch_size` rows (ids `[rows, seq_len]`, attention mask), the batches calibration reads texts as."""
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
