"""Which model an artifact is for: `model_identity` reads, from a loaded model, the fields an artifact records in its
`model` object (`patchkv.artifact_format`), and `check_compatible` holds a model against such a record."""

from __future__ import annotations

from typing import Any

from torch import nn

from .adapters import adapter_for, attention_modules
from .artifact_format import CHECKED_FIELDS, SLIDING_WINDOWS, dtype_name
from .errors import IncompatibleArtifactError


def model_identity(model: nn.Module) -> dict[str, Any]:
    """The fields of `model` that an artifact must match, plus its name and architecture class; `sliding_windows`
    only for a model with a sliding-window layer."""
    config = model.config
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    attn = modules[0]
    windows = [adapter.sliding_window(m) for m in modules]
    return {
        "model_type": config.model_type,
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "name_or_path": config.name_or_path or "",
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": adapter.head_dim(attn),
        "hidden_size": config.hidden_size,
        "dtype": dtype_name(adapter.dtype(attn)),
        **({SLIDING_WINDOWS: windows} if any(w is not None for w in windows) else {}),
    }


def check_compatible(recorded: dict[str, Any], model: nn.Module) -> None:
    """Raise `IncompatibleArtifactError` listing every field in which `model` differs from `recorded` (an artifact's
    `model` object), with what to do about it."""
    found = model_identity(model)
    diffs = [f"{f}: artifact has {recorded.get(f)!r}, model has {found.get(f)!r}"
             for f in (*CHECKED_FIELDS, SLIDING_WINDOWS) if recorded.get(f) != found.get(f)]
    if not diffs:
        return
    fix = "Calibrate an artifact for this model with patchkv.calibrate(model, texts, ...)"
    if [d.split(":")[0] for d in diffs] == [SLIDING_WINDOWS] and SLIDING_WINDOWS not in recorded:
        fix = ("The artifact predates format version 6, which records the layers' windows (budgets count bytes "
               f"by them): artifact.with_sliding_windows({found[SLIDING_WINDOWS]}) records them")
    raise IncompatibleArtifactError(
        f"Artifact calibrated for {recorded.get('name_or_path') or recorded.get('model_type')!r} does not "
        f"match this model ({found['name_or_path'] or found['model_type']!r}):\n  " + "\n  ".join(diffs)
        + f"\n{fix}."
    )
