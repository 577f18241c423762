"""The configurations a measurement compares, built in one place for `patchkv report`, `patchkv eval` and the
benchmark suite (`python -m evals`, whose registry `evals/suite.py` lists its own from these constructors):

    unpatched()                                   # the model as it is, its own 16-bit cache
    quantized_cache(4)                            # transformers' QuantizedCache, quanto int4, groups of 64,
                                                  #   the last 128 tokens kept whole (the only place one is built)
    budget(Budget(ratio=8))                       # patchkv codes meeting 8x at the context (`patchkv.budgets`)
    peer("kvpress KVzipPress r=0.9375")           # a peer run elsewhere (evals/peers), scored into the same records

A configuration's `family` names the line it joins in a plot (a peer's family is its name up to " r=").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .allocation import step_scales_for
from .artifact import Artifact
from .budgets import Budget
from .methods import Method, Quantized


@dataclass(frozen=True)
class Config:
    """One named configuration. `kind` is "unpatched", "quantized_cache", "patchkv" or "peer"; a patchkv one codes
    with `budget`'s methods (and `extra` after them) from the artifact of its `mode` (None: the one artifact
    given); a quantized_cache one runs through the cache `cache(model)` makes."""

    name: str
    kind: str
    family: str
    budget: Budget | None = None
    mode: str | None = None
    extra: tuple[Method, ...] = ()
    cache: Callable[[nn.Module], Any] | None = None
    note: str = ""

    def methods(self, artifact: Artifact, context: int) -> list[Method]:
        """The methods meeting the budget at `context` tokens on `artifact`, then `extra`."""
        if self.budget is None:
            raise ValueError(f"configuration {self.name!r} ({self.kind}) has no patchkv methods.")
        return [*self.budget.methods(artifact, context), *self.extra]

    def patch(self, artifacts: Artifact | Mapping[str, Artifact], context: int) -> tuple[Artifact, list[Method]] | None:
        """(artifact, methods) for `patchkv.patched` at `context` tokens, or None for a configuration patchkv does not
        patch. `artifacts`: one artifact, or artifacts by mode ("pre_rope", "post_rope")."""
        if self.budget is None:
            return None
        if isinstance(artifacts, Artifact):
            artifact = artifacts
        elif self.mode in artifacts:
            artifact = artifacts[self.mode]
        else:
            raise ValueError(f"configuration {self.name!r} needs a {self.mode} artifact; given {sorted(artifacts)}.")
        return artifact, self.methods(artifact, context)

    def spec(self, artifact: Artifact, context: int) -> str:
        """The methods as `--method` specs ("sinks:... + quantized:..."), saying when the artifact has no step scales
        for the budget's codes."""
        methods = self.methods(artifact, context)
        codes = next(m for m in methods if isinstance(m, Quantized))
        scaled = step_scales_for(artifact, codes.bits, codes.pool) is not None
        return " + ".join(m.spec() for m in methods) + ("" if scaled else " (no step scales for this budget)")

    def unavailable(self, model: nn.Module) -> str:
        """Why this configuration cannot run on `model` ("not run: ..."), or "" when it can (`QuantizedCache` refuses
        models with sliding-window layers, and needs its backend installed)."""
        if self.cache is None:
            return ""
        try:
            self.cache(model)
        except (ImportError, ValueError, TypeError, NotImplementedError) as e:
            return f"not run: {' '.join(str(e).split())[:140]}"
        return ""


def unpatched() -> Config:
    """The model as it is."""
    return Config("unpatched", "unpatched", "unpatched")


def quantized_cache(nbits: int, backend: str = "quanto", name: str | None = None) -> Config:
    """transformers' `QuantizedCache` at `nbits`, groups of 64, its last 128 tokens kept in full precision."""

    def cache(model: nn.Module) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(backend=backend, config=model.config, nbits=nbits, q_group_size=64, residual_length=128)

    return Config(name or f"QuantizedCache {backend} int{nbits}", "quantized_cache", "quantized_cache", cache=cache,
                  note=f"QuantizedCache {backend} int{nbits} g64 residual 128")


def budget(target: Budget, name: str | None = None, *, mode: str | None = None, extra: tuple[Method, ...] = (),
           family: str | None = None, note: str = "") -> Config:
    """patchkv codes meeting `target` at the context they run at (named "patchkv <target>" unless `name`), in the
    family `family_of(target)` unless `family` is given."""
    return Config(name or f"patchkv {target}", "patchkv", family or family_of(target), budget=target, mode=mode,
                  extra=extra, note=note)


def family_of(target: Budget) -> str:
    """The plot line a budget joins: "patchkv" and what it keeps beside the codes ("patchkv+near", "patchkv+int8
    window 16+near+novelty"), so that one line joins the ratios of one method family."""
    exact = target.regions
    window = "" if exact is None else f"+{f'int{exact.bits} ' if exact.bits != 16 else ''}window {exact.window}" + (
        f", {exact.sink_tokens} sinks" if exact.sink_tokens != 4 else "")
    basis = "-layer" if target.basis == "layer" else ""
    return f"patchkv{basis}{window}" + "".join(f"+{m.spec()}" for m in (target.near, target.evict, target.salience)
                                               if m is not None)


def peer(name: str) -> Config:
    """A configuration run outside patchkv (a kvpress press, "kvpress <Press> r=<ratio>"), known by its name."""
    return Config(name, "peer", name.split(" r=")[0])
