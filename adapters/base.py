"""The adapter contract: everything patchkv needs to know about one architecture family's attention.

patchkv's patched forward (`patchkv.attention`) never touches a projection, a norm, a rotary table or an
attribute of the attention module directly; it asks the family's adapter. `AttentionAdapter` implements
the Llama layout (`q_proj`/`k_proj`/`v_proj`/`o_proj`, rotate-half RoPE over the whole head, one rotary
table). A family that differs overrides only the methods where it differs: fused qkv (Phi-3), q/k norms
(Qwen3, Gemma 3), per-layer-type RoPE tables and sliding windows (Gemma 3), logit softcap, scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..compat import attention_function, execution_device, rotary_modules
from ..kernels.reference import rotate_half


class AttentionAdapter:
    """Llama-style attention. Shapes: q `[batch, heads, seq, head_dim]`, k and v `[batch, kv_heads, seq, head_dim]`."""

    #: `config.model_type` values this adapter handles.
    model_types: tuple[str, ...] = ()
    #: The attention module class the adapter patches.
    attention_class: type[nn.Module]
    #: Rotate-half RoPE over the first `rotary_dim` dimensions; the Triton kernels implement this convention.
    rope_convention = "rotate_half"

    @property
    def name(self) -> str:
        return self.model_types[0]

    # ----- shapes, dtype, device -----------------------------------------------------------------
    def head_dim(self, attn: nn.Module) -> int:
        return attn.head_dim

    def num_kv_heads(self, attn: nn.Module) -> int:
        return attn.config.num_key_value_heads

    def query_groups(self, attn: nn.Module) -> int:
        """Query heads per KV head (GQA)."""
        return attn.num_key_value_groups

    def key_weight(self, attn: nn.Module) -> torch.Tensor:
        """The parameter that produces keys: its dtype is the model's compute dtype for this layer."""
        return attn.k_proj.weight

    def dtype(self, attn: nn.Module) -> torch.dtype:
        return self.key_weight(attn).dtype

    # ----- projections ---------------------------------------------------------------------------
    def project_qkv(self, attn: nn.Module, hidden_states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states `[batch, seq, hidden]` -> un-rotated (but normalised) q, k, v, heads before seq."""
        q, k, v = self.linear_qkv(attn, hidden_states)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim(attn))
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        q, k = self.normalize_qk(attn, q, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def linear_qkv(self, attn: nn.Module, hidden_states: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw projections `[batch, seq, heads * head_dim]` (and `kv_heads * head_dim` for k, v)."""
        return attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)

    def normalize_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation before RoPE (none for Llama). q, k: `[batch, seq, heads, head_dim]`."""
        return q, k

    def output(self, attn: nn.Module, attn_output: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, heads * head_dim]` -> `[batch, seq, hidden]`."""
        return attn.o_proj(attn_output)

    def decoder(self, model: nn.Module) -> nn.Module:
        """The decoder stack whose forward receives `cache=` (e.g. `LlamaModel` inside `LlamaForCausalLM`)."""
        return model.get_decoder() if hasattr(model, "get_decoder") else model

    # ----- rotary embedding ----------------------------------------------------------------------
    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        """The model's rotary embedding module (one per model in every supported family)."""
        found = rotary_modules(model)
        if len(found) != 1:
            raise ValueError(f"Expected one rotary embedding module in the {self.name} model, found {len(found)}.")
        return found[0]

    def rope_key(self, attn: nn.Module) -> Any:
        """Which rotary table this layer uses (layers with equal keys share one)."""
        return None

    def cos_sin(self, rotary: nn.Module, attn: nn.Module, like: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[batch, n, rotary_dim]` for integer `positions` `[batch, n]`, as the model computes them."""
        return rotary(like, positions)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on x `[batch, heads, seq, head_dim]` with cos, sin `[batch or 1, seq, rotary_dim]` (head axis
        added here). Only the first `rotary_dim` dimensions rotate (partial rotary); the rest pass through."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        turned, kept = x[..., :rot], x[..., rot:]
        return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)

    # ----- the attention kernel ------------------------------------------------------------------
    def scaling(self, attn: nn.Module) -> float:
        return attn.scaling

    def sliding_window(self, attn: nn.Module) -> int | None:
        """This layer's attention window, or None for full attention."""
        return None

    def attention_kwargs(self, attn: nn.Module) -> dict[str, Any]:
        """Extra keyword arguments the family's forward passes to its attention function (window, softcap)."""
        window = self.sliding_window(attn)
        return {} if window is None else {"sliding_window": window}

    def attention_function(self, attn: nn.Module) -> Callable:
        """The attention function the model is configured with, defaulting to the family's own eager one
        (which carries family details such as Gemma's logit softcap)."""
        return attention_function(attn)

    # ----- placement -----------------------------------------------------------------------------
    def execution_device(self, model: nn.Module, attn: nn.Module) -> torch.device:
        """Where this layer computes. For a model dispatched by accelerate (CPU or disk offload) parameters
        may sit on `meta` between forwards: the device of the nearest accelerate hook wins."""
        names = {module: name for name, module in model.named_modules()}
        path = names.get(attn, "")
        parts = path.split(".") if path else []
        for depth in range(len(parts), -1, -1):
            module = model.get_submodule(".".join(parts[:depth]))
            device = execution_device(module)
            if device is not None:
                return device
        return self.key_weight(attn).device
