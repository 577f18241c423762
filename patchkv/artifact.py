"""The artifact's data model: `Components` (one kind's bases) and `Artifact` (keys and values with the model and
calibration they belong to), loaded and saved as `patchkv.artifact_format` specifies, checked by
`patchkv.artifact_checks`."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize
from torch import nn

from . import hub
from .allocation import compression_ratio
from .artifact_checks import (check_calibration, check_components, check_model_fields, check_ranks, check_tensor_set,
                              parse_budgets, parse_metadata)
from .artifact_format import (FILENAME, FORMAT_VERSION, KINDS, LAYER_NAMES, LAYER_WEIGHTS, MODEL_DTYPES,
                              MODES, SLIDING_WINDOWS, STEP_BUDGETS, STEP_SCALES, TENSOR_NAMES, WEIGHTS, checksum,
                              dtype_name, file_sha256, header_metadata, layer_groups, parse_sha256)
from .errors import ArtifactError, InvalidArtifactError
from .identity import check_compatible, model_identity
from .pca import select_ranks

#: the names code imports from here; FILENAME, FORMAT_VERSION, KINDS, MODES, dtype_name and file_sha256 belong to
#: `patchkv.artifact_format`, model_identity to `patchkv.identity`
__all__ = ["FILENAME", "FORMAT_VERSION", "KINDS", "MODES", "Artifact", "Components", "dtype_name", "file_sha256",
           "model_identity"]


@dataclass
class Components:
    """PCA of keys or of values, all layers stacked, and optionally the components' effect weights, the heads'
    quantizer step scales (`[budgets, L, H]`, one slice per entry of the artifact's `step_budgets`) and the layer
    bases (`layer_mean` `[L, H * d]`, `layer_eigenvalues` `[L, H * d]`, `layer_eigenvectors` `[L, H * d, H * d]`:
    one PCA per layer over its KV heads concatenated; or one per span of S consecutive layers, `[L / S, S * H * d]`,
    format version 7). Shapes as in the format spec (`patchkv.artifact_format`)."""

    mean: torch.Tensor
    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    ranks: torch.Tensor
    weights: torch.Tensor | None = None
    step_scales: torch.Tensor | None = None
    layer_mean: torch.Tensor | None = None
    layer_eigenvalues: torch.Tensor | None = None
    layer_eigenvectors: torch.Tensor | None = None
    layer_weights: torch.Tensor | None = None

    @property
    def has_layer_bases(self) -> bool:
        return self.layer_mean is not None

    @property
    def layers_per_basis(self) -> int:
        """How many consecutive layers each layer basis spans (`layer_mean` `[L / S, S * H * d]`); 0 without them."""
        return self.layer_mean.shape[-1] // (self.mean.shape[1] * self.mean.shape[2]) if self.has_layer_bases else 0

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        out = {
            f"{kind}.mean": self.mean.float().contiguous(),
            f"{kind}.eigenvalues": self.eigenvalues.float().contiguous(),
            f"{kind}.eigenvectors": self.eigenvectors.float().contiguous(),
            f"{kind}.ranks": self.ranks.to(torch.int32).contiguous(),
        }
        if self.weights is not None:
            out[f"{kind}.{WEIGHTS}"] = self.weights.float().contiguous()
        if self.step_scales is not None:
            out[f"{kind}.{STEP_SCALES}"] = self.step_scales.float().contiguous()
        if self.has_layer_bases:
            out.update({f"{kind}.{name}": getattr(self, name).float().contiguous() for name in LAYER_NAMES})
        if self.layer_weights is not None:
            out[f"{kind}.{LAYER_WEIGHTS}"] = self.layer_weights.float().contiguous()
        return out


class Artifact:
    """Calibrated bases for one model and one mode: the data of the format, its load / save / validation, and
    small accessors. Create with `patchkv.calibrate` or `Artifact.load`. What a budget makes of it (bits per
    component, bytes per token, the step scales a budget codes with) is in `patchkv.allocation`."""

    def __init__(self, *, mode: str, model: dict[str, Any], keys: Components, values: Components,
                 calibration: dict[str, Any] | None = None, step_budgets: list[tuple[int, str]] | None = None):
        """step_budgets: with step scales, the `(bits, pool)` of `Quantized` each slice of them was fitted for."""
        if not isinstance(mode, str) or mode not in MODES:
            raise InvalidArtifactError(f"mode must be one of {MODES}, got {mode!r}.")
        if not isinstance(model, dict):
            raise InvalidArtifactError(f"model must be a dict of the model's identity fields, got {model!r:.80}.")
        if calibration is not None and not isinstance(calibration, dict):
            raise InvalidArtifactError(f"calibration must be a dict (or None), got {calibration!r:.80}.")
        self.mode = mode
        self.model = dict(model)
        self.keys = keys
        self.values = values
        self.calibration = dict(calibration or {})
        self.step_budgets = [(b, p) for b, p in step_budgets] if step_budgets is not None else None
        self._validate()

    # ----- sizes -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.keys.mean.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.mean.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.mean.shape[2]

    @property
    def element_size(self) -> int:
        """Bytes per element of the model dtype the artifact is declared for."""
        return torch.empty(0, dtype=getattr(torch, self.model["dtype"])).element_size()

    @property
    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window, None for a layer that attends to every token (all None for a model
        without sliding-window layers)."""
        return list(self.model.get(SLIDING_WINDOWS) or [None] * self.num_layers)

    @property
    def has_effect_weights(self) -> bool:
        return self.keys.weights is not None

    @property
    def has_step_scales(self) -> bool:
        return self.keys.step_scales is not None

    @property
    def has_layer_bases(self) -> bool:
        """Whether `Quantized(basis="layer")` can code on it (format version 5)."""
        return self.keys.has_layer_bases

    @property
    def layers_per_basis(self) -> int:
        """How many consecutive layers each layer basis spans: 1 for one basis per layer (format version 5), more
        for bases across layers (version 7); 0 without layer bases."""
        return self.keys.layers_per_basis

    @property
    def layer_groups(self) -> list[list[int]]:
        """The layers each layer basis spans, one list per row of the layer tensors: S consecutive layers of one
        attention kind (`patchkv.artifact_format.layer_groups`); [] without layer bases."""
        span = self.layers_per_basis
        return layer_groups(self.sliding_windows, span) if span else []

    @property
    def format_version(self) -> int:
        """The version this artifact is written at: 7 with layer bases spanning several layers, else 6 for a model
        with sliding-window layers, else 5 with layer bases, else 4 with step scales, else 2 with effect weights,
        else 1."""
        if self.layers_per_basis > 1:
            return 7
        if SLIDING_WINDOWS in self.model:
            return 6
        return 5 if self.has_layer_bases else 4 if self.has_step_scales else 2 if self.has_effect_weights else 1

    # ----- re-targeting ------------------------------------------------------------------------
    def with_ranks(self, rank: int | None = None, energy: float | None = None) -> Artifact:
        """A copy keeping `rank` components per head, or the fewest that explain `energy` of the variance.

        Keys and values are truncated separately from their own spectra; no recalibration is needed.
        """
        out = copy.deepcopy(self)
        out.keys.ranks = select_ranks(self.keys.eigenvalues, rank, energy)
        out.values.ranks = select_ranks(self.values.eigenvalues, rank, energy)
        out.calibration["rank_selection"] = {"rank": rank, "energy": energy}
        for kind in KINDS:
            check_ranks(kind, getattr(out, kind).ranks, out.head_dim)
        return out

    def to_dtype(self, dtype: torch.dtype) -> Artifact:
        """A copy declared for a model in `dtype` (bases are cast at `apply`). Use when you accept running
        bases calibrated in one precision on a model in another."""
        name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
        if name not in MODEL_DTYPES:
            raise InvalidArtifactError(f"to_dtype needs one of torch.{', torch.'.join(MODEL_DTYPES)}, got {dtype!r}.")
        out = copy.deepcopy(self)
        out.model["dtype"] = name
        return out

    def with_sliding_windows(self, windows: list[int | None]) -> Artifact:
        """A copy (tensors shared) recording each layer's attention window (None: full attention), for an artifact
        of a model with sliding-window layers saved before format version 6; all None records none."""
        model = {k: v for k, v in self.model.items() if k != SLIDING_WINDOWS}
        if any(w is not None for w in windows):
            model[SLIDING_WINDOWS] = list(windows)
        return Artifact(mode=self.mode, model=model, keys=self.keys, values=self.values,
                        calibration=dict(self.calibration), step_budgets=self.step_budgets)

    # ----- compatibility -----------------------------------------------------------------------
    def check_compatible(self, model: nn.Module) -> None:
        """Raise `IncompatibleArtifactError` listing every field in which `model` differs from the artifact."""
        check_compatible(self.model, model)

    # ----- serialisation -----------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.keys.tensors("keys"), **self.values.tensors("values")}

    def metadata(self) -> dict[str, Any]:
        meta = {"format_version": self.format_version, "mode": self.mode, "model": self.model,
                "calibration": self.calibration}
        if self.has_step_scales:
            meta[STEP_BUDGETS] = [{"bits": int(b), "pool": p} for b, p in self.step_budgets]
        meta["checksum"] = checksum(self.tensors(), meta)
        return meta

    def save(self, path: str | Path) -> Path:
        """Write the artifact to `path` (a `.safetensors` file, or a directory that gets `patchkv.safetensors`).

        Returns the file written. The file appears complete or not at all (written to a temporary file in the
        same folder, then renamed over `path`): a full disk or an interrupt leaves any earlier file as it was and
        no temporary file behind. Its mode is that of any new file, 0o666 less the umask.
        """
        self._validate()  # attributes may have been changed since construction: never write an invalid file
        file = _resolve(_path(path), creating=True)
        file.parent.mkdir(parents=True, exist_ok=True)
        # a single metadata entry: safetensors writes metadata keys in hash order, and files must be reproducible
        data = serialize(self.tensors(), metadata={"patchkv": json.dumps(self.metadata())})
        _write_atomically(file, data)
        return file

    @classmethod
    def load(cls, path: str | Path, *, sha256: str | None = None) -> Artifact:
        """Read an artifact, verifying everything listed under "What is verified" in `patchkv.artifact_format`.

        sha256: optionally, the expected sha256 of the file's bytes (as `sha256sum` prints it), bare hex or
        "sha256:<hex>". Raises `ArtifactError` on any defect, naming the file.
        """
        expected = parse_sha256(sha256)
        file = _resolve(_path(path), creating=False)
        try:  # read once: the hash is checked on, and the artifact parsed from, the same bytes
            data = file.read_bytes()
        except OSError as e:
            raise ArtifactError(f"{file} could not be read: {e.strerror or e}.") from e
        if expected is not None:
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise ArtifactError(
                    f"{file} has sha256 {actual}, expected {expected}: it is not the file you asked for, or it is "
                    "corrupted. Download or save it again, or check the expected hash."
                )
        try:
            tensors = load_tensors(data)
            header = header_metadata(data)
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
            raise ArtifactError(
                f"{file} is not a readable safetensors file ({e}). It is truncated or corrupted: "
                "download or save it again."
            ) from e
        del data
        if "patchkv" not in header:
            raise ArtifactError(f"{file} is a safetensors file but not a patchkv artifact (no 'patchkv' metadata).")
        meta = parse_metadata(file, header["patchkv"])
        claimed = meta.pop("checksum")
        try:
            actual = checksum(tensors, meta)
        except (TypeError, ValueError, RecursionError) as e:  # pragma: no cover - JSON that parsed re-serialises
            raise InvalidArtifactError(f"{file}: the 'patchkv' metadata cannot be canonicalised ({e}).") from e
        if claimed != actual:
            raise ArtifactError(
                f"{file} failed its checksum (stored {claimed}, computed {actual}): the file is corrupted. "
                "Download or save it again."
            )
        try:
            check_model_fields(meta["model"])
            version = meta["format_version"]
            sliding = SLIDING_WINDOWS in meta["model"]
            if (version == 6 and not sliding) or (sliding and version < 6):
                raise InvalidArtifactError(f"model.{SLIDING_WINDOWS} is given always in format version 6 (a model "
                                           f"with sliding-window layers), optionally in 7 and never before; this file "
                                           f"is version {version}.")
            check_tensor_set(tensors, version, STEP_BUDGETS in meta)
            budgets = None
            if version in (4, 5, 6, 7) and STEP_BUDGETS in meta:
                budgets = parse_budgets(meta[STEP_BUDGETS], meta["model"]["head_dim"], STEP_BUDGETS)
            elif version == 3:  # one budget, recorded in the calibration summary: read once, here, into a typed field
                record = meta["calibration"].get("step_scales")
                if isinstance(record, dict):
                    record = {k: record[k] for k in ("bits", "pool") if k in record}
                budgets = parse_budgets([record], meta["model"]["head_dim"],
                                         'calibration["step_scales"] (version 3: the budget of its step scales)')
                for kind in KINDS:
                    tensors[f"{kind}.{STEP_SCALES}"] = tensors[f"{kind}.{STEP_SCALES}"].unsqueeze(0)
            parts = {kind: Components(*(tensors[f"{kind}.{n}"] for n in TENSOR_NAMES),
                                      weights=tensors.get(f"{kind}.{WEIGHTS}"),
                                      step_scales=tensors.get(f"{kind}.{STEP_SCALES}"),
                                      **{name: tensors.get(f"{kind}.{name}") for name in (*LAYER_NAMES, LAYER_WEIGHTS)})
                     for kind in KINDS}
            artifact = cls(mode=meta["mode"], model=meta["model"], calibration=meta["calibration"],
                           step_budgets=budgets, **parts)
            if (version == 7) != (artifact.layers_per_basis > 1):
                raise InvalidArtifactError(f"layer bases span several layers exactly in format version 7; this file is "
                                           f"version {version} and its layer bases span "
                                           f"{artifact.layers_per_basis} layer(s).")
            return artifact
        except InvalidArtifactError as e:
            raise InvalidArtifactError(f"{file} is not a valid patchkv artifact: {e}") from e

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = True, **kwargs: Any) -> str:
        """Upload to the Hugging Face Hub with a model card; see `patchkv.hub.push_to_hub`."""
        return hub.push_to_hub(self, repo_id, token=token, private=private, **kwargs)

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str | Path, **kwargs: Any) -> Artifact:
        """Load from a local path, or download from the Hub; see `patchkv.hub.from_pretrained`."""
        return hub.from_pretrained(repo_id_or_path, cls.load, **kwargs)

    def _validate(self) -> None:
        """The content checks of the format spec (step 7), vectorised over layers and heads."""
        check_model_fields(self.model)
        check_calibration(self.calibration)
        for kind in KINDS:
            if not isinstance(getattr(self, kind), Components):
                raise InvalidArtifactError(f"{kind} must be a patchkv.artifact.Components, "
                                           f"got {type(getattr(self, kind)).__name__}.")
        mean = self.keys.mean
        if not isinstance(mean, torch.Tensor) or mean.dim() != 3 or 0 in mean.shape:
            raise InvalidArtifactError(f"keys.mean must be a tensor [layers, kv_heads, head_dim], got "
                                       f"{tuple(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__}.")
        layers, heads, dim = mean.shape
        for kind in KINDS:
            check_components(kind, getattr(self, kind), layers, heads, dim)
        for field, what in ((WEIGHTS, "effect weights"), (STEP_SCALES, "step scales"), ("layer_mean", "layer bases")):
            given = [kind for kind in KINDS if getattr(getattr(self, kind), field) is not None]
            if len(given) == 1:
                raise InvalidArtifactError(f"{what} must be given for keys and values both, or for neither; "
                                           f"found them for {given[0]} only.")
        if self.keys.layers_per_basis != self.values.layers_per_basis:
            raise InvalidArtifactError(f"keys' layer bases span {self.keys.layers_per_basis} layer(s) and values' "
                                       f"{self.values.layers_per_basis}: both kinds must span the same layers.")
        if self.layers_per_basis > 1:
            try:
                self.layer_groups
            except ValueError as e:
                raise InvalidArtifactError(f"its layer bases cannot be grouped over the model's layers: {e}") from None
        if self.has_step_scales != (self.step_budgets is not None):
            raise InvalidArtifactError("step scales come with step_budgets (the (bits, pool) each was fitted for), "
                                       "and step_budgets with step scales; found one without the other.")
        if self.has_step_scales:
            self.step_budgets = [tuple(x) for x in parse_budgets(
                [{"bits": b, "pool": p} for b, p in self.step_budgets], dim, "step_budgets")]
            for kind in KINDS:
                count = getattr(self, kind).step_scales.shape[0]
                if count != len(self.step_budgets):
                    raise InvalidArtifactError(f"{kind}.step_scales has {count} budget(s), step_budgets lists "
                                               f"{len(self.step_budgets)}.")
        found = {"num_hidden_layers": layers, "num_key_value_heads": heads, "head_dim": dim}
        diffs = [f"{k}={self.model[k]} (tensors have {v})" for k, v in found.items() if self.model[k] != v]
        if diffs:
            raise InvalidArtifactError(f"tensor shapes [layers={layers}, kv_heads={heads}, head_dim={dim}] disagree "
                                       f"with the model metadata: {', '.join(diffs)}.")

    def __repr__(self) -> str:
        return (f"Artifact(mode={self.mode!r}, model={self.model.get('name_or_path') or self.model['model_type']!r}, "
                f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"mean key rank={self.keys.ranks.float().mean():.1f}, "
                f"mean value rank={self.values.ranks.float().mean():.1f}, "
                f"compression={compression_ratio(self):.2f}x"
                + (f", step scales for {', '.join(f'{b} bits/{p}' for b, p in self.step_budgets)}"
                   if self.has_step_scales else "") + ")")


def _path(path: str | Path) -> Path:
    """`path` with `~` expanded; an empty string is refused rather than taken as the current folder."""
    if isinstance(path, str) and not path:
        raise ArtifactError("The artifact path is an empty string: give a .safetensors file or a folder ('.' for "
                            "the current one).")
    return hub.expand_user(path)


def _write_atomically(file: Path, data: bytes) -> None:
    """Write `data` to a new temporary file beside `file`, flush it to disk, and rename it over `file`; on any
    failure (a full disk, a KeyboardInterrupt) the temporary file is removed and `file` is left as it was.
    The temporary file is created with mode 0o666, which the umask reduces as for any new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    tmp = None
    try:
        while tmp is None:
            candidate = file.with_name(f".{file.name[:200]}.{secrets.token_hex(6)}.tmp")
            try:
                fd = os.open(candidate, flags, 0o666)
            except FileExistsError:
                continue
            tmp = candidate
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:  # name the file asked for, not the temporary one
            raise OSError(e.errno, e.strerror, str(file)) from e
        raise


def _resolve(path: Path, *, creating: bool) -> Path:
    if path.suffix == ".safetensors":
        file = path
    elif path.is_dir() or creating:
        file = path / FILENAME
    else:
        file = path
    if not creating and not file.is_file():
        raise ArtifactError(f"No artifact at {file}: expected a .safetensors file or a directory holding {FILENAME}.")
    return file
