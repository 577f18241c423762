"""`NearCodes`: the newest coded tokens, those that just left the window, at a higher rate than the rest.

    position:  0 .. sinks-1 | ...            | the `tokens` before the window   | the last `window`
    stored as: exact K/V    | codes          | codes at `factor` x the bits     | exact K/V

Attention reads the tokens just behind the window more than older ones, and codes blur every token alike. On 4,096
tokens of SmolLM2's calibration text at 16x (the shipped bases), the newest 224, 480 or 960 coded tokens at twice
the bits, the rest a little coarser to pay for them, take perplexity from +14.1% to +11.5%, +9.0% and +7.2%: the
default keeps 960. As tokens leave the window they are coded at the near rate; once more than `tokens` are held
there, the oldest are coded again at the middle's rate (decoded, then encoded on the same basis), a block of at least
a sixty-fourth of `tokens` at a time (15 of the default 960: a decode step recodes once every 15 steps, not each
step, and the region holds 946 to 960 tokens). A budget pays for them (`parse_budget("16x+near")`): the middle's bits
are what is left.

Needs a codec with a rate (`Quantized`); not combined with a `Selector` (refused when the plan is built). With a
`Salience` method ("16x+near+novelty") the tokens it keeps exact are chosen among the near tokens and the middle alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import CachePlan, Method, spec_of


@dataclass(frozen=True)
class NearCodes(Method):
    """The newest `tokens` coded tokens of each layer at `factor` times the bits of the rest of the middle."""

    name = "near"
    role = "near"
    tokens: int = 960
    factor: int = 2

    def __post_init__(self):
        self.integers(1, "tokens", "factor")

    def spec(self) -> str:
        """`near` and the fields that differ from their defaults ("near", "near:tokens=480")."""
        return spec_of(self)

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, near=self)
