"""`SinksWindow`: the first `sink_tokens` and the last `window` tokens stay exact K/V (or the window int8 / int4).

    position:  0 .. sinks-1 | sinks .. T-window-1 | T-window .. T-1
    stored as: exact K/V    | latents (or codes)  | exact K/V (bits=16), int8 / int4 K/V + a scale per token (8, 4)

New tokens enter the window; as they leave it they are encoded into the middle. On layers with a
sliding attention window (Mistral, Qwen2, Gemma 3's local layers) the whole window is stored as latents:
there the method does not apply (`LatentCache.describe()` says so per layer).

bits 8 holds the window between forwards as int8 with a float32 scale per token, head and kind (symmetric, the
largest magnitude at 127, as `Salience(bits=8)` holds its copies): a relative error under 0.4% for about half the
bytes (`token_bytes`), so a budget buys twice the window, or more bits for the codes; bits 4 holds it as int4, two
to a byte (the largest magnitude at 7). A forward reads its own tokens exact, and the sinks stay exact. Tokens leave
the window for the codes (and a salience method's copies) from its read-back, so an int4 window's error reaches
them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .base import CachePlan, Method, check_bits, spec_of, token_kv_bytes


@dataclass(frozen=True)
class SinksWindow(Method):
    """The first `sink_tokens` and the last `window` tokens of every layer kept exact (the window int8 at `bits=8`,
    int4 at `bits=4`)."""

    name = "sinks"
    role = "regions"
    sink_tokens: int = 4
    window: int = 0
    bits: int = field(default=16, kw_only=True)

    def __post_init__(self):
        self.integers(0, "sink_tokens", "window")
        object.__setattr__(self, "bits", check_bits("sinks", self.bits, "an exact window, or int8 / int4 with a scale"))

    def spec(self) -> str:
        """`sinks:sink_tokens=4,window=32`, and `,bits=8` for an int8 window (`,bits=4` int4)."""
        return spec_of(self, always=("sink_tokens", "window"))

    def token_bytes(self, head_dim: int) -> int:
        """Bytes one window token's key and value take in one KV head of `head_dim`: 16-bit, or int8 / int4 and a
        float32 scale each."""
        return token_kv_bytes(head_dim, self.bits)

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, sink_tokens=self.sink_tokens, window=self.window, window_bits=self.bits)
