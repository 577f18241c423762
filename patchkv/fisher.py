"""Effect weights: how much an error in each cached key or value component costs the model's loss.

A squared error is the wrong measure for a compressed cache: an error along a direction the queries never
look at costs nothing, one along a direction attention (or the output projection) amplifies costs a lot.
For a cached vector x with compression error e, the loss changes by about g^T e, g = d loss / d x, so the
expected cost is e^T F e with the Fisher matrix F = E[g g^T]. On a PCA basis with components u_j and
variances lambda_j, an error of relative size D on component j costs lambda_j * (u_j^T F u_j) * D: the effect
weight w_j = u_j^T F u_j puts every component of every layer, head, key and value in the same unit (nats),
so one bit pool can be shared by all of them (`patchkv.allocation.allocate_to_bytes`).

`FisherCapture` measures F during calibration. While it is active each attention module runs the library's
own attention path (`patchkv.attention.attention_forward`, the one the patched model runs: the adapter's projections,
the mode, the model's own attention function) in float32, over a layer of its own (`FisherProbe`) that holds every
token twice, `[exact | perturbed]`: the perturbed copy carries a zero perturbation `delta` (requiring grad) added in
cache space, and a mask lets each query read each key from the copy its pair is served from: pairs (query i, key j)
where j is one of the row's first `sink_tokens` real tokens or j is within the `window` most recent tokens of i
(i - j < window) read exact keys and values, as the `SinksWindow` method serves them at inference. One backward pass
of the summed next-token loss per row gives d loss / d delta = the gradient through the compressed path only; its
outer products, summed in float64 over the non-sink tokens, are F. In `pre_rope` mode the perturbation is added
before the rotary embedding (the cache holds un-rotated keys), in `post_rope` mode after.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import AttentionAdapter
from .artifact_format import layer_groups
from .attention import attention_forward
from .compat import accelerate_hook
from .key_space import MODES
from .methods import Observation, build_plan
from .patch import LayerPatch, Patch
from .rope import RopeTable
from .visible import Visible


class FisherProbe:
    """The layer the attention path reads while `FisherCapture` measures a row (`attention_forward`'s `layer`, an
    `AttentionLayer`): every token twice, exact (where attention reads sinks) and perturbed (where it reads the
    window); there is no middle. `deltas`: the zero perturbations of the last forward, float32 `[1, kv_heads, seq, head_dim]`
    keys and values, in cache space."""

    def __init__(self) -> None:
        self.deltas: tuple[torch.Tensor, torch.Tensor] | None = None

    def get_seq_length(self) -> int:
        return 0

    def update_latent(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> Visible:
        """keys, values `[1, kv_heads, seq, head_dim]` in cache space, positions `[1, seq]` -> `[exact | perturbed]`."""
        dk, dv = torch.zeros_like(keys, requires_grad=True), torch.zeros_like(values, requires_grad=True)
        self.deltas = dk, dv
        no_middle = keys.new_zeros(keys.shape[0], 0, 0)
        return Visible(keys, values, keys + dk, values + dv, no_middle, no_middle, positions, positions[:, :0],
                       positions)

    def after_attention(self, observed: Observation | None = None) -> None:
        pass


class FisherForward:
    """The `forward` installed on an attention module while `FisherCapture` runs (a plain object, restored after).

    Without an active row it calls the module's own forward."""

    def __init__(self, capture: FisherCapture, attn: nn.Module, lp: LayerPatch, original: Any):
        self.capture, self.attn, self.lp, self.original = capture, attn, lp, original

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.capture.row is None:
            return self.original(hidden_states, position_embeddings, attention_mask, **kwargs)
        hook = accelerate_hook(self.attn)  # accelerate: load offloaded weights around the forward
        if hook is not None:
            (hidden_states, position_embeddings), _ = hook.pre_forward(self.attn, hidden_states, position_embeddings)
        kwargs.pop("past_key_values", None)  # use_cache=False: the probe is this forward's only layer
        probe = FisherProbe()
        out = attention_forward(self.attn, self.lp, probe, hidden_states, position_embeddings,
                                self.capture.mask(self.attn), compute_dtype=torch.float32, **kwargs)
        self.capture.row["deltas"][self.attn.layer_idx] = probe.deltas
        return hook.post_forward(self.attn, out) if hook is not None else out


class FisherCapture:
    """Accumulates per-layer, per-KV-head Fisher matrices of keys and values. Use as a context manager:

        with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=4, window=32) as fisher:
            fisher.step(input_ids, attention_mask, position_ids)    # one [1, seq] row at a time
        fisher.keys, fisher.values   # float64 [layers, kv_heads, head_dim, head_dim] sums; fisher.count tokens

    With `layers=S` >= 1 it also accumulates the whole Fisher matrix of each span of S layers (S consecutive layers of
    one attention kind, `patchkv.artifact_format.layer_groups`) over their KV heads concatenated, `fisher.layer_keys`,
    `fisher.layer_values` float64 `[layers / S, S * D, S * D]` (D = kv_heads * head_dim; the per-head matrices are its
    diagonal blocks, and with S > 1 it holds the cross-layer terms), for the effect weights of layer bases (S = 1: one
    per layer).
    """

    def __init__(self, model: nn.Module, adapter: AttentionAdapter, modules: list[nn.Module], *, mode: str,
                 sink_tokens: int, window: int, layers: int = 0):
        self.model, self.adapter, self.modules = model, adapter, modules
        self.sink_tokens, self.window = sink_tokens, window
        heads, dim = adapter.num_kv_heads(modules[0]), adapter.head_dim(modules[0])
        self.keys = torch.zeros(len(modules), heads, dim, dim, dtype=torch.float64)
        self.values = torch.zeros_like(self.keys)
        self.span, width = int(layers), int(layers) * heads * dim
        windows = [adapter.sliding_window(m) for m in modules]
        self.groups = layer_groups(windows, self.span) if self.span else []  # raises where S does not divide a kind
        self.layer_keys = torch.zeros(len(self.groups), width, width, dtype=torch.float64) if layers else None
        self.layer_values = torch.zeros_like(self.layer_keys) if layers else None
        self.count = 0
        self.row: dict[str, Any] | None = None  # the row being measured: masks and perturbations
        self._restore: list[tuple[nn.Module, Any]] = []
        # what the attention path reads of a patch: adapter, mode, rotary tables (no codecs: the probe has no middle)
        patch = Patch(adapter, MODES[mode], build_plan([]), None, "fisher", windows)
        rotary, tables = adapter.rotary_embedding(model), {}
        self.layers = [LayerPatch(patch, attn.layer_idx, None, None,
                                  tables.setdefault(adapter.rope_key(attn), RopeTable(adapter, rotary, attn)))
                       for attn in modules]

    def __enter__(self) -> FisherCapture:
        for attn, lp in zip(self.modules, self.layers):
            previous = vars(attn).get("forward")
            self._restore.append((attn, previous))
            attn.forward = FisherForward(self, attn, lp,
                                         previous if previous is not None else type(attn).forward.__get__(attn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for attn, previous in self._restore:
            if previous is None:
                del attn.forward
            else:
                attn.forward = previous
        self._restore.clear()

    def sums(self) -> dict[str, Any]:
        """What was measured so far: the Fisher sums "keys", "values" (float64 `[layers, kv_heads, d, d]`),
        "layer_keys", "layer_values" (`[layers / S, S * D, S * D]`, None without `layers`) and the "count" of tokens
        summed."""
        return {"keys": self.keys, "values": self.values, "layer_keys": self.layer_keys,
                "layer_values": self.layer_values, "count": self.count}

    def mask(self, attn: nn.Module) -> torch.Tensor:
        """The current row's additive float32 mask `[1, 1, seq, 2 seq]` over `[exact | perturbed]`: each query reads
        each visible key from the copy its pair is served from (a sliding layer sees its last `window` keys only)."""
        allowed, exact = self.row["allowed"], self.row["exact"]
        window = self.adapter.sliding_window(attn)
        if window is not None:
            allowed = allowed & (self.row["offset"] < window)
        keep = torch.cat([allowed & exact, allowed & ~exact], dim=-1)  # [seq, 2 seq]
        return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill(
            ~keep, torch.finfo(torch.float32).min)[None, None]

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             counted: torch.Tensor, device: torch.device, scored: torch.Tensor | None = None) -> float:
        """One row: input_ids, attention_mask, position_ids, counted (the tokens whose gradients enter F,
        bool) all `[1, seq]`. Runs a forward and a backward of the summed next-token loss; returns that loss
        (nats). scored: bool `[1, seq]`, the tokens whose prediction (from the tokens before them) enters the loss
        (None: every real token after the first); e.g. only an answer's tokens, for a retrieval row."""
        real = attention_mask.bool()
        # exact pairs: the row's first sink_tokens real tokens, and keys within `window` of the query
        sink = real & (attention_mask.cumsum(1) <= self.sink_tokens)
        pos = position_ids[0]
        offset = pos[:, None] - pos[None, :]                                   # [seq, seq] query - key
        allowed = real[0][None, :] & (offset >= 0)
        exact = sink[0][None, :] | (offset < self.window)
        self.row = {"allowed": allowed.to(device), "exact": exact.to(device), "offset": offset.to(device),
                    "deltas": {}}
        try:
            with torch.enable_grad():
                logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                    position_ids=position_ids.to(device), use_cache=False).logits
                wanted = real[:, 1:] if scored is None else real[:, 1:] & scored[:, 1:].bool()
                targets = input_ids[:, 1:].masked_fill(~wanted, -100).to(logits.device)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="sum",
                                       ignore_index=-100)
                deltas = [self.row["deltas"][attn.layer_idx] for attn in self.modules]
                with torch.profiler.record_function("patchkv::fisher_backward"):
                    grads = torch.autograd.grad(loss, [d for pair in deltas for d in pair], allow_unused=True)
        finally:
            self.row = None
        keep, n = counted[0], int(counted[0].sum())
        heads, dim = self.keys.shape[1], self.keys.shape[2]
        flat = {"keys": [], "values": []}  # each layer's [n, kv_heads * head_dim] gradients (None: the loss does
        for layer in range(len(self.modules)):  # not reach its cache), for the layer bases
            for kind, g in (("keys", grads[2 * layer]), ("values", grads[2 * layer + 1])):
                if g is not None:
                    g = g[0][:, keep.to(g.device)].double()                    # [kv_heads, n, head_dim]
                    getattr(self, kind)[layer] += (g.mT @ g).cpu()
                if self.span:
                    flat[kind].append(None if g is None else g.transpose(0, 1).reshape(n, heads * dim))
        for kind in ("keys", "values") if self.span else ():
            whole = getattr(self, f"layer_{kind}")
            for group, layers in enumerate(self.groups):
                parts = [flat[kind][layer] for layer in layers]
                device = next((p.device for p in parts if p is not None), None)  # the span's last layer's may differ
                if device is None:
                    continue
                span = torch.cat([torch.zeros(n, heads * dim, dtype=torch.float64, device=device) if p is None
                                  else p.to(device) for p in parts], dim=1)    # [n, S * kv_heads * head_dim]
                whole[group] += (span.T @ span).cpu()
        self.count += n
        return loss.item()


def effect_weights(fisher: torch.Tensor, eigenvectors: torch.Tensor) -> torch.Tensor:
    """w[..., j] = u_j^T F[...] u_j: fisher `[..., d, d]`, eigenvectors `[..., d, d]` (column j = u_j) ->
    `[..., d]` float64 (per head: `[layers, heads, d]`; per layer: `[layers, D]`)."""
    u = eigenvectors.double()
    return torch.einsum("...ij,...ik,...kj->...j", u, fisher.double(), u).clamp_min(0)
