"""The patchkv artifact: calibrated PCA bases for one model, as safetensors plus JSON metadata.

Format, version 1
=================
One safetensors file (`patchkv.safetensors` when saved into a directory). With `L` layers,
`H` KV heads and head dimension `d`, it holds ten tensors, for `kind` in `keys`, `values`:

    {kind}.mean          float32 [L, H, d]     mean of the calibration vectors
    {kind}.eigenvalues   float32 [L, H, d]     variances along each component, descending
    {kind}.eigenvectors  float32 [L, H, d, d]  column j of [l, h] is component j
    {kind}.ranks         int32   [L, H]        components kept per head, each in [1, d]

Keys are the vectors the cache would hold: un-rotated keys in `pre_rope` mode, rotated keys in
`post_rope` mode. The whole spectrum is stored so that `Artifact.with_ranks` can re-truncate
without recalibrating; only `ranks` components per head are used at inference.

The safetensors header metadata carries one entry, `"patchkv"`, a JSON object:

    format_version  1
    mode            "pre_rope" | "post_rope"
    model           {"model_type", "architecture", "name_or_path", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                     "dtype"}; `apply` refuses a model whose fields differ (name and
                     architecture class excepted)
    calibration     free-form summary: source, tokens, sequences, seq_len, sink_tokens,
                    rank selection
    checksum        "sha256:<hex>" over every tensor (name, dtype, shape, bytes, in name
                    order) and the canonical JSON of the metadata without `checksum`

Loading uses safetensors only: no pickle, no code is executed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .errors import ArtifactError, IncompatibleArtifactError
from .pca import select_ranks

FORMAT_VERSION = 1
FILENAME = "patchkv.safetensors"
MODES = ("pre_rope", "post_rope")
KINDS = ("keys", "values")
_CHECKED_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "hidden_size", "dtype")


@dataclass
class Components:
    """PCA of keys or of values, all layers stacked. Shapes as in the format spec above."""

    mean: torch.Tensor
    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    ranks: torch.Tensor

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return {
            f"{kind}.mean": self.mean.float().contiguous(),
            f"{kind}.eigenvalues": self.eigenvalues.float().contiguous(),
            f"{kind}.eigenvectors": self.eigenvectors.float().contiguous(),
            f"{kind}.ranks": self.ranks.to(torch.int32).contiguous(),
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_identity(model: nn.Module) -> dict[str, Any]:
    """The fields of `model` that an artifact must match, plus its name and architecture class."""
    from .adapters import adapter_for, attention_modules

    config = model.config
    attn = attention_modules(model, adapter_for(model))[0]
    return {
        "model_type": config.model_type,
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": attn.head_dim,
        "hidden_size": config.hidden_size,
        "dtype": dtype_name(attn.k_proj.weight.dtype),
    }


class Artifact:
    """Calibrated bases for one model and one mode. Create with `patchkv.calibrate` or `Artifact.load`."""

    def __init__(self, *, mode: str, model: dict[str, Any], keys: Components, values: Components,
                 calibration: dict[str, Any] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        self.mode = mode
        self.model = dict(model)
        self.keys = keys
        self.values = values
        self.calibration = dict(calibration or {})
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
        return torch.empty(0, dtype=getattr(torch, self.model["dtype"])).element_size()

    def bit_allocation(self, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bits per component `[layers, kv_heads, head_dim]` for keys and for values, `bits` per head and
        token each, by dynamic programming on the eigenvalues (`patchkv.quantize.allocate_bits`)."""
        from .quantize import allocate_bits

        return allocate_bits(self.keys.eigenvalues, bits), allocate_bits(self.values.eigenvalues, bits)

    def full_kv_bytes_per_token(self) -> int:
        """Bytes per token of the uncompressed cache: 2 (K and V) x layers x KV heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    def kv_bytes_per_token(self, bits: int | None = None) -> int:
        """Bytes per token of the latent cache: the kept components of K and V, summed over layers and heads;
        with `bits`, the quantized codes (each layer's K and V codes rounded up to whole bytes)."""
        if bits is None:
            return int(self.keys.ranks.sum() + self.values.ranks.sum()) * self.element_size
        return sum(int(-(-int(a[layer].sum()) // 8)) for a in self.bit_allocation(bits) for layer in range(len(a)))

    def compression_ratio(self, bits: int | None = None) -> float:
        """Uncompressed bytes per token divided by latent bytes per token."""
        return self.full_kv_bytes_per_token() / self.kv_bytes_per_token(bits)

    # ----- re-targeting ------------------------------------------------------------------------
    def with_ranks(self, rank: int | None = None, energy: float | None = None) -> Artifact:
        """A copy keeping `rank` components per head, or the fewest that explain `energy` of the variance.

        Keys and values are truncated separately from their own spectra; no recalibration is needed.
        """
        out = copy.deepcopy(self)
        out.keys.ranks = select_ranks(self.keys.eigenvalues, rank, energy)
        out.values.ranks = select_ranks(self.values.eigenvalues, rank, energy)
        out.calibration["rank_selection"] = {"rank": rank, "energy": energy}
        return out

    def to_dtype(self, dtype: torch.dtype) -> Artifact:
        """A copy declared for a model in `dtype` (bases are cast at `apply`). Use when you accept running
        bases calibrated in one precision on a model in another."""
        out = copy.deepcopy(self)
        out.model["dtype"] = dtype_name(dtype)
        return out

    # ----- compatibility -----------------------------------------------------------------------
    def check_compatible(self, model: nn.Module) -> None:
        """Raise `IncompatibleArtifactError` listing every field in which `model` differs from the artifact."""
        found = model_identity(model)
        diffs = [f"{f}: artifact has {self.model.get(f)!r}, model has {found[f]!r}"
                 for f in _CHECKED_FIELDS if self.model.get(f) != found[f]]
        if not diffs:
            return
        fix = "Calibrate an artifact for this model with patchkv.calibrate(model, texts, ...)"
        if [d.split(":")[0] for d in diffs] == ["dtype"]:
            fix = (f"Load the model in {self.model['dtype']}, or accept the precision change with "
                   f"artifact.to_dtype(torch.{found['dtype']})")
        raise IncompatibleArtifactError(
            f"Artifact calibrated for {self.model.get('name_or_path') or self.model.get('model_type')!r} does not "
            f"match this model ({found['name_or_path'] or found['model_type']!r}):\n  " + "\n  ".join(diffs)
            + f"\n{fix}."
        )

    # ----- serialisation -----------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.keys.tensors("keys"), **self.values.tensors("values")}

    def metadata(self) -> dict[str, Any]:
        meta = {"format_version": FORMAT_VERSION, "mode": self.mode, "model": self.model,
                "calibration": self.calibration}
        meta["checksum"] = _checksum(self.tensors(), meta)
        return meta

    def save(self, path: str | Path) -> Path:
        """Write the artifact to `path` (a `.safetensors` file, or a directory that gets `patchkv.safetensors`).

        Returns the file written.
        """
        file = _resolve(Path(path), creating=True)
        file.parent.mkdir(parents=True, exist_ok=True)
        # a single metadata entry: safetensors writes metadata keys in hash order, and files must be reproducible
        save_file(self.tensors(), str(file), metadata={"patchkv": json.dumps(self.metadata())})
        return file

    @classmethod
    def load(cls, path: str | Path) -> Artifact:
        """Read an artifact, verifying format version and checksum. Raises `ArtifactError` on any defect."""
        file = _resolve(Path(path), creating=False)
        try:
            with safe_open(str(file), framework="pt") as f:
                header = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ArtifactError(
                f"{file} is not a readable safetensors file ({e}). It is truncated or corrupted: "
                "download or save it again."
            ) from e
        if "patchkv" not in header:
            raise ArtifactError(f"{file} is a safetensors file but not a patchkv artifact (no 'patchkv' metadata).")
        try:
            meta = json.loads(header["patchkv"])
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{file}: the 'patchkv' metadata is not valid JSON ({e}); the file is corrupted.") from e
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{file} has artifact format version {version!r}; this patchkv reads version {FORMAT_VERSION}. "
                "Install the patchkv version that wrote it, or recalibrate."
            )
        claimed = meta.pop("checksum", None)
        actual = _checksum(tensors, meta)
        if claimed != actual:
            raise ArtifactError(
                f"{file} failed its checksum (stored {claimed}, computed {actual}): the file is corrupted. "
                "Download or save it again."
            )
        try:
            parts = {kind: Components(*(tensors[f"{kind}.{n}"] for n in ("mean", "eigenvalues", "eigenvectors",
                                                                         "ranks")))
                     for kind in KINDS}
            return cls(mode=meta["mode"], model=meta["model"], calibration=meta.get("calibration"), **parts)
        except (KeyError, ValueError) as e:
            raise ArtifactError(f"{file} is not a valid patchkv artifact: {e}") from e

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = True, **kwargs: Any) -> str:
        """Upload to the Hugging Face Hub with a model card; see `patchkv.hub.push_to_hub`."""
        from .hub import push_to_hub

        return push_to_hub(self, repo_id, token=token, private=private, **kwargs)

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str | Path, **kwargs: Any) -> Artifact:
        """Load from a local path, or download from the Hub; see `patchkv.hub.from_pretrained`."""
        from .hub import from_pretrained

        return from_pretrained(repo_id_or_path, **kwargs)

    def _validate(self) -> None:
        layers, heads, dim = self.keys.mean.shape
        for kind, c in (("keys", self.keys), ("values", self.values)):
            expected = {"mean": (layers, heads, dim), "eigenvalues": (layers, heads, dim),
                        "eigenvectors": (layers, heads, dim, dim), "ranks": (layers, heads)}
            for name, shape in expected.items():
                if tuple(getattr(c, name).shape) != shape:
                    raise ValueError(f"{kind}.{name} has shape {tuple(getattr(c, name).shape)}, expected {shape}")
            bad = c.ranks[(c.ranks < 1) | (c.ranks > dim)]
            if bad.numel():
                raise ValueError(f"{kind}.ranks must lie in [1, head_dim={dim}], found {bad.tolist()[:4]}")
        if self.model.get("head_dim") != dim or self.model.get("num_key_value_heads") != heads \
                or self.model.get("num_hidden_layers") != layers:
            raise ValueError(f"tensor shapes [layers={layers}, kv_heads={heads}, head_dim={dim}] disagree with "
                             f"the model metadata {self.model}")

    def __repr__(self) -> str:
        return (f"Artifact(mode={self.mode!r}, model={self.model.get('name_or_path') or self.model['model_type']!r}, "
                f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"mean key rank={self.keys.ranks.float().mean():.1f}, "
                f"mean value rank={self.values.ranks.float().mean():.1f}, "
                f"compression={self.compression_ratio():.2f}x)")


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


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    body = {k: v for k, v in meta.items() if k != "checksum"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return "sha256:" + h.hexdigest()
