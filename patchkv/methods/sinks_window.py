"""`SinksWindow`: the first `sink_tokens` and the last `window` tokens stay exact K/V.

    position:  0 .. sinks-1 | sinks .. T-window-1 | T-window .. T-1
    stored as: exact K/V    | latents (or codes)  | exact K/V

New tokens enter the window; as they leave it they are encoded into the middle. On layers with a
sliding attention window (Mistral, Qwen2, Gemma 3's local layers) the whole window is stored as latents:
there the method does not apply (`LatentCache.describe()` says so per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import CachePlan, Method, check_int


@dataclass(frozen=True)
class SinksWindow(Method):
    name = "sinks"
    role = "regions"
    sink_tokens: int = 4
    window: int = 0

    def __post_init__(self):
        object.__setattr__(self, "sink_tokens", check_int("sinks", "sink_tokens", self.sink_tokens, 0))
        object.__setattr__(self, "window", check_int("sinks", "window", self.window, 0))

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, sink_tokens=self.sink_tokens, window=self.window)
