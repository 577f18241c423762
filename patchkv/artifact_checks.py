"""The checks an artifact passes, in the order `patchkv.artifact_format` lists them under "What is verified": the
'patchkv' metadata entry (steps 2-5), the set of tensors a file holds (step 6), and the contents of the bases (step 7,
run on every `Artifact`, loaded or built in memory). Each raises `InvalidArtifactError` naming what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .artifact_format import (CALIBRATION_MAX_CHARS, CALIBRATION_MAX_DEPTH, EIGENVALUE_RTOL, INT_FIELDS, KINDS,
                              LAYER_NAMES, LAYER_WEIGHTS, MAX_BITS, META_FIELDS, MODEL_DTYPES, MODEL_FIELDS, MODES,
                              ORTHONORMAL_TOL, POOLS, READABLE_VERSIONS, SLIDING_WINDOWS, STEP_BUDGETS, STEP_SCALES,
                              STR_FIELDS, TENSOR_NAMES, WEIGHTS, dtype_name)
from .errors import ArtifactError, InvalidArtifactError

if TYPE_CHECKING:  # the checks read a `Components`' tensors; patchkv.artifact, above, runs them
    from .artifact import Components


def parse_metadata(file: Path, text: str) -> dict[str, Any]:
    """Steps 2-4 of the spec (JSON object, fields, version, checksum field) on the raw 'patchkv' entry."""
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArtifactError(f"{file}: the 'patchkv' metadata is not valid JSON ({e}); the file is "
                                   "corrupted.") from e
    except RecursionError as e:
        raise InvalidArtifactError(f"{file}: the 'patchkv' metadata is nested too deeply to parse; the file is "
                                   "corrupted or hostile.") from e
    if not isinstance(meta, dict):
        raise InvalidArtifactError(f"{file}: the 'patchkv' metadata must be a JSON object, found a JSON "
                                   f"{_json_type(meta)}; the file is corrupted.")
    version = meta.get("format_version")
    if "format_version" in meta and (version not in READABLE_VERSIONS or not isinstance(version, int)
                                     or isinstance(version, bool)):
        raise ArtifactError(
            f"{file} has artifact format version {version!r}; this patchkv reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Install the patchkv version that wrote it, or recalibrate."
        )
    budgeted = version == 4 or (version in (5, 6, 7) and STEP_BUDGETS in meta)  # versions 5-7: step scales optional
    fields = META_FIELDS + ((STEP_BUDGETS,) if budgeted else ())
    missing = [k for k in fields if k not in meta]
    extra = sorted(k for k in meta if k not in fields)
    if missing or extra:
        raise InvalidArtifactError(
            f"{file}: the 'patchkv' metadata must have exactly the fields {list(fields)}"
            + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "") + "."
        )
    claimed = meta["checksum"]
    if not isinstance(claimed, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", claimed):
        raise InvalidArtifactError(f"{file}: checksum must be a string 'sha256:<64 hex digits>', got {claimed!r:.90}.")
    if not isinstance(meta["mode"], str) or meta["mode"] not in MODES:
        raise InvalidArtifactError(f"{file}: mode must be one of {MODES}, got {meta['mode']!r:.90}.")
    for name in ("model", "calibration"):
        if not isinstance(meta[name], dict):
            raise InvalidArtifactError(f"{file}: '{name}' must be a JSON object, found a JSON "
                                       f"{_json_type(meta[name])} ({meta[name]!r:.60}).")
    return meta


def check_model_fields(model: dict[str, Any]) -> None:
    if not isinstance(model, dict):
        raise InvalidArtifactError(f"model must be an object of identity fields, got {model!r:.80}.")
    missing = [k for k in MODEL_FIELDS if k not in model]
    if missing:
        raise InvalidArtifactError(f"model is missing the field(s) {missing} (see patchkv.identity.model_identity).")
    extra = sorted(str(k) for k in model if k not in (*MODEL_FIELDS, SLIDING_WINDOWS))
    if extra:
        raise InvalidArtifactError(f"model has the unexpected field(s) {extra}; the format has exactly "
                                   f"{list(MODEL_FIELDS)} (see patchkv.identity.model_identity).")
    for k in STR_FIELDS:
        if not isinstance(model[k], str):
            raise InvalidArtifactError(f"model.{k} must be a string, got {model[k]!r:.80}.")
    for k in INT_FIELDS:
        if not isinstance(model[k], int) or isinstance(model[k], bool) or model[k] < 1:
            raise InvalidArtifactError(f"model.{k} must be a positive integer, got {model[k]!r:.80}.")
    if model["dtype"] not in MODEL_DTYPES:
        raise InvalidArtifactError(f"model.dtype must be one of {MODEL_DTYPES}, got {model['dtype']!r:.80}.")
    if SLIDING_WINDOWS in model:
        windows = model[SLIDING_WINDOWS]
        if (not isinstance(windows, list) or len(windows) != model["num_hidden_layers"]
                or not all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1) for w in windows)
                or all(w is None for w in windows)):
            raise InvalidArtifactError(f"model.{SLIDING_WINDOWS} must list each of the {model['num_hidden_layers']} "
                                       f"layers' attention window (a positive integer, or null for full attention), "
                                       f"at least one an integer; got {windows!r:.80}.")


def check_calibration(calibration: dict[str, Any]) -> None:
    """Step 5 for `calibration`: JSON-serialisable, at most CALIBRATION_MAX_CHARS characters of JSON, objects and
    arrays nested at most CALIBRATION_MAX_DEPTH deep (itself included), checked without recursion."""
    too_deep = InvalidArtifactError(
        f"calibration nests objects and arrays more than {CALIBRATION_MAX_DEPTH} deep; it is a free-form summary "
        "(patchkv's own nests 5 deep): flatten it, or keep deeper records in a file of their own.")
    try:
        size = len(json.dumps(calibration, sort_keys=True))
    except RecursionError:
        raise too_deep from None
    except (TypeError, ValueError) as e:
        raise InvalidArtifactError(f"calibration must be JSON-serialisable (it is saved as JSON): {e}") from e
    if size > CALIBRATION_MAX_CHARS:
        raise InvalidArtifactError(f"calibration takes {size:,} characters of JSON, more than the "
                                   f"{CALIBRATION_MAX_CHARS:,} allowed for a free-form summary (patchkv's own takes a "
                                   "few thousand): keep larger records in a file of their own.")
    level = [calibration]  # the containers at one depth; as many as the JSON's size allows
    for _ in range(CALIBRATION_MAX_DEPTH):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list, tuple))]
    if level:
        raise too_deep


def parse_budgets(budgets: Any, head_dim: int, where: str) -> list[tuple[int, str]]:
    """Step 5 for `step_budgets`: a non-empty list of distinct {"bits": int in [1, 8 head_dim], "pool": one of
    POOLS} objects -> [(bits, pool), ...]."""
    if not isinstance(budgets, list) or not budgets:
        raise InvalidArtifactError(f"{where} must be a non-empty list of budgets, got {budgets!r:.80}.")
    out = []
    for budget in budgets:
        if not isinstance(budget, dict) or sorted(budget) != ["bits", "pool"]:
            raise InvalidArtifactError(f"{where}: each budget must be an object with exactly the fields 'bits' and "
                                       f"'pool', got {budget!r:.80}.")
        bits, pool = budget["bits"], budget["pool"]
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS * head_dim:
            raise InvalidArtifactError(f"{where}: bits must be an integer in [1, {MAX_BITS * head_dim}], got "
                                       f"{bits!r:.40}.")
        if pool not in POOLS:
            raise InvalidArtifactError(f"{where}: pool must be one of {POOLS}, got {pool!r:.40}.")
        out.append((bits, pool))
    if len(set(out)) != len(out):
        raise InvalidArtifactError(f"{where} lists a budget twice: {out}.")
    return out


def check_tensor_set(tensors: dict[str, torch.Tensor], version: int, budgeted: bool) -> None:
    """Step 6: exactly the eight (version 1), ten (version 2), ten or twelve (versions 3 and 4: step scales, with
    or without effect weights) or the version 5 set (the layer bases; step scales when `budgeted`, the metadata
    lists step budgets), or in version 6 the eight with any of those sets, or in version 7 the version 5 set, float32
    / int32 as stored in the file."""
    scaled = version in (3, 4) or (version in (5, 6, 7) and budgeted)
    with_weights = version == 2 or (version >= 3 and any(name.endswith(f".{WEIGHTS}") for name in tensors))
    layered = version in (5, 7) or (version == 6 and any(name.endswith(f".{LAYER_NAMES[0]}") for name in tensors))
    stored = TENSOR_NAMES + ((WEIGHTS,) if with_weights else ()) + ((STEP_SCALES,) if scaled else ()) \
        + (LAYER_NAMES + ((LAYER_WEIGHTS,) if with_weights else ()) if layered else ())
    names = {f"{kind}.{n}" for kind in KINDS for n in stored}
    missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
    if missing or extra:
        raise InvalidArtifactError(f"expected exactly the tensors {sorted(names)}"
                                   + (f"; missing {missing}" if missing else "")
                                   + (f"; unexpected {extra}" if extra else "") + ".")
    for name, t in tensors.items():
        want = torch.int32 if name.endswith(".ranks") else torch.float32
        if t.dtype != want:
            raise InvalidArtifactError(f"{name} is stored as {dtype_name(t.dtype)}; the format stores "
                                       f"{dtype_name(want)}.")


def check_components(kind: str, c: Components, layers: int, heads: int, dim: int) -> None:
    """Step 7 for one kind: the heads' bases (`_check_basis` over `[L, H]`, head dimension d); ranks `[L, H]` in
    [1, d]; step scales `[B, L, H]`, where given, finite and > 0; the layer bases, where given (`_check_basis` over
    `[L / S]`, width S * H * d for the S layers each spans, S dividing L), with layer weights exactly when the heads
    have effect weights."""
    _check_basis(kind, c, "", (layers, heads), dim)
    _check_tensor(kind, "ranks", c.ranks, (layers, heads), (torch.int32, torch.int64))
    check_ranks(kind, c.ranks, dim)
    if c.step_scales is not None:
        scales = c.step_scales
        _check_tensor(kind, STEP_SCALES, scales, (scales.shape[0] if scales.dim() == 3 else -1, layers, heads))
        _check_finite(kind, STEP_SCALES, torch.isfinite(scales).all(0))
        if (scales <= 0).any():
            raise _where(kind, STEP_SCALES, (scales <= 0).any(0),
                         f"step scales must be > 0, found {scales[scales <= 0].min().item():.3g}")
    if c.has_layer_bases:
        if (c.weights is None) != (c.layer_weights is None):
            raise InvalidArtifactError(f"{kind}.layer_weights must be given exactly when the heads' effect weights "
                                       f"are ({'missing' if c.layer_weights is None else 'given without them'}); "
                                       "recalibrate with layer_bases=True and fisher_tokens > 0.")
        span = layers_per_basis(kind, c.layer_mean, layers, heads * dim)
        _check_basis(kind, c, "layer_", (layers // span,), span * heads * dim)
    elif c.layer_weights is not None:
        raise InvalidArtifactError(f"{kind}.layer_weights are given without layer bases.")


def layers_per_basis(kind: str, layer_mean: Any, layers: int, width: int) -> int:
    """How many consecutive layers each of a kind's layer bases spans, read from `layer_mean` `[L / S, S * width]`
    (`width` = H * d): S >= 1 dividing L, or an error saying what the shape should be."""
    shape = tuple(layer_mean.shape) if isinstance(layer_mean, torch.Tensor) else None
    span = shape[1] // width if shape is not None and len(shape) == 2 else 0
    if span < 1 or shape[1] % width or layers % span or shape[0] != layers // span:
        raise InvalidArtifactError(
            f"{kind}.layer_mean has shape {shape}, expected [{layers} / S, S x {width}]: one row per span of S "
            f"consecutive layers (S dividing {layers}; S = 1 for one basis per layer), {width} = kv_heads x head_dim "
            "columns per layer.")
    return span


def _check_basis(kind: str, c: Components, prefix: str, units: tuple[int, ...], dim: int) -> None:
    """One basis per unit (a head: `units` = (L, H); a layer: (L,)), its tensors named `prefix` + mean, eigenvalues,
    eigenvectors, weights: `[*units, dim]`, `[*units, dim]`, `[*units, dim, dim]` and, where given, `[*units, dim]`;
    float, finite, the effect weights >= 0, the eigenvalues sorted descending and >= 0 up to round-off (negative
    round-off is clamped to 0 here), each unit's eigenvectors orthonormal. Errors name the first unit at fault."""
    mean, eigenvalues, eigenvectors, weights = (prefix + name for name in ("mean", "eigenvalues", "eigenvectors", WEIGHTS))
    shapes = {mean: (*units, dim), eigenvalues: (*units, dim), eigenvectors: (*units, dim, dim)}
    if getattr(c, weights) is not None:
        shapes[weights] = (*units, dim)
    for name, shape in shapes.items():
        t = getattr(c, name)
        _check_tensor(kind, name, t, shape)
        _check_finite(kind, name, torch.isfinite(t).reshape(*units, -1).all(-1))
    w = getattr(c, weights)
    if w is not None and (w < 0).any():
        raise _where(kind, weights, (w < 0).any(-1), f"effect weights must be >= 0, found {w[w < 0].min().item():.3g}")
    ev = getattr(c, eigenvalues).double()
    tol = EIGENVALUE_RTOL * ev.abs().amax(-1, keepdim=True)  # [*units, 1]
    negative = (ev < -tol).any(-1)
    if negative.any():
        raise _where(kind, eigenvalues, negative,
                     f"eigenvalues must be >= 0 (variances), found {ev[negative].min().item():.3g}")
    unsorted = ((ev[..., 1:] - ev[..., :-1]) > tol).any(-1)
    if unsorted.any():
        raise _where(kind, eigenvalues, unsorted, "eigenvalues must be sorted in descending order")
    if (getattr(c, eigenvalues) < 0).any():  # round-off: clamp, so downstream logs and square roots see >= 0
        setattr(c, eigenvalues, getattr(c, eigenvalues).clamp_min(0))
    v = getattr(c, eigenvectors).double()
    error = (v.mT @ v - torch.eye(dim, dtype=torch.float64)).abs().amax((-2, -1))  # [*units]
    bad = error > ORTHONORMAL_TOL
    if bad.any():
        raise _where(kind, eigenvectors, bad, f"eigenvectors are not orthonormal: max |VᵀV - I| = "
                     f"{error[bad].max().item():.3g} > {ORTHONORMAL_TOL:g}")


def _check_tensor(kind: str, name: str, t: Any, shape: tuple[int, ...],
                  allowed: tuple[torch.dtype, ...] = (torch.float32, torch.float64)) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArtifactError(f"{kind}.{name} must be a torch.Tensor, got {type(t).__name__}.")
    if tuple(t.shape) != shape:
        raise InvalidArtifactError(f"{kind}.{name} has shape {tuple(t.shape)}, expected {shape}.")
    if t.dtype not in allowed:
        raise InvalidArtifactError(f"{kind}.{name} has dtype {dtype_name(t.dtype)}; expected "
                                   f"{' or '.join(dtype_name(d) for d in allowed)}.")


def _check_finite(kind: str, name: str, finite: torch.Tensor) -> None:
    """`finite`: `[L, H]` or `[L]`, whether each head's or layer's values of `{kind}.{name}` are all finite."""
    if not finite.all():
        raise _where(kind, name, ~finite, "holds NaN or Inf values")


def check_ranks(kind: str, ranks: torch.Tensor, dim: int) -> None:
    """Ranks `[L, H]` each in [1, dim]."""
    bad = (ranks < 1) | (ranks > dim)
    if bad.any():
        raise _where(kind, "ranks", bad, f"ranks must lie in [1, head_dim={dim}], found {ranks[bad].tolist()[:4]}")


def _where(kind: str, name: str, bad: torch.Tensor, what: str) -> InvalidArtifactError:
    """An error naming the first offending head of a `[layers, heads]` mask (or layer of a `[layers]` mask), and how
    many there are."""
    place = ", ".join(f"{axis} {int(i)}" for axis, i in zip(("layer", "head"), bad.nonzero()[0]))
    count, units = int(bad.sum()), "heads" if bad.dim() == 2 else "layers"
    return InvalidArtifactError(f"{kind}.{name} at {place}: {what}"
                                + (f" ({count} of {bad.numel()} {units} are affected)" if count > 1 else "") + ".")


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)
