"""Compression methods, one small class per file, and the registry the CLI and the evals read.

    patchkv.apply(model, artifact, methods=[SinksWindow(4, 32), Quantized(bits=64), TopK(k=64, rank=8)])
    parse_method("topk:k=64,rank=8")  # the same, from a string (`patchkv eval --method ...`)
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable

from .attention_mass import AttentionMass
from .base import CachePlan, CodecMethod, Method, Observation, Salience, Selector
from .code_error import CodeError
from .evict import Evict
from .key_norm import KeyNorm
from .lowrank import LowRank
from .near import NearCodes
from .novelty import Novelty
from .quantized import Quantized
from .sinks_window import SinksWindow
from .topk import TopK

#: name -> method class; `patchkv eval --method NAME:field=value,...` and the evals look methods up here.
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (AttentionMass, CodeError, Evict, KeyNorm, LowRank,
                                                               NearCodes, Novelty, Quantized, SinksWindow, TopK)}


def parse_method(spec: str) -> Method:
    """`"name"` or `"name:field=value,field=value"` -> a method instance (values typed by the dataclass fields)."""
    name, _, args = spec.partition(":")
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r} in {spec!r}; known methods: {', '.join(METHODS)}.")
    cls = METHODS[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"Method {name!r}: expected field=value with a field among {sorted(fields)}, got {item!r}.")
        hint = str(hints[key])
        kind = str if hint in ("str", "<class 'str'>") else float if "float" in hint else int
        try:
            kwargs[key] = kind(value)
        except ValueError:
            raise ValueError(f"Method {name!r}: {key} must be {'a number' if kind is float else 'an integer'}, "
                             f"got {value!r}.") from None
    return cls(**kwargs)


def from_options(sink_tokens: int | None = None, window: int | None = None, bits: int | None = None,
                 top_k: int | None = None, top_k_rank: int | None = None) -> list[Method]:
    """The methods `patchkv.apply`'s keyword shorthands (and the matching CLI flags) stand for."""
    out: list[Method] = []
    if sink_tokens is not None or window is not None:
        out.append(SinksWindow(0 if sink_tokens is None else sink_tokens, 0 if window is None else window))
    if bits is not None:
        out.append(Quantized(bits))
    if top_k_rank is not None and top_k is None:
        raise ValueError("top_k_rank needs top_k: pass top_k=<tokens per KV head> as well.")
    if top_k is not None:
        out.append(TopK(top_k, top_k_rank))
    return out


def build_plan(methods: Iterable[Method]) -> CachePlan:
    """Fold methods into one plan: at most one method per role; `LowRank()` when no codec is given."""
    methods = tuple(methods)
    seen: dict[str, Method] = {}
    for m in methods:
        if not isinstance(m, Method):
            raise TypeError(f"Expected patchkv methods (see patchkv.methods.METHODS), got {m!r}.")
        if m.role in seen:
            raise ValueError(f"Two {m.role} methods given ({seen[m.role].spec()} and {m.spec()}); pass one.")
        seen[m.role] = m
    if "salience" in seen and "selection" in seen:
        raise ValueError(f"{seen['salience'].spec()} and {seen['selection'].spec()} cannot be combined: a decode step "
                         "reads either the chosen tokens or the exact salient ones; pass one of them.")
    if "near" in seen and "selection" in seen:
        raise ValueError(f"{seen['near'].spec()} and {seen['selection'].spec()} cannot be combined yet: near codes "
                         "are read as a region of their own, which top-k selection does not choose from; pass one.")
    plan = CachePlan(codec=LowRank(), methods=methods)
    for m in methods:
        plan = m.configure(plan)
    return plan


__all__ = ["METHODS", "AttentionMass", "CachePlan", "CodeError", "CodecMethod", "Evict", "KeyNorm", "LowRank",
           "Method", "NearCodes", "Novelty", "Observation", "Quantized", "Salience", "Selector", "SinksWindow", "TopK",
           "build_plan", "from_options", "parse_method"]
