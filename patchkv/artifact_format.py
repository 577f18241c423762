"""The patchkv artifact format: calibrated PCA bases for one model, as safetensors plus JSON metadata.

This module is the format: its spec (below), the names and bounds the spec gives, the checksum and the reading of
a file's header. The data model, with load and save, is `patchkv.artifact` (`Artifact`, `Components`).

Format, versions 1 to 7
=======================
One safetensors file (`patchkv.safetensors` when saved into a directory). With `L` layers,
`H` KV heads and head dimension `d`, a version 1 file holds exactly eight tensors, for `kind` in `keys`,
`values`:

    {kind}.mean          float32 [L, H, d]     mean of the calibration vectors
    {kind}.eigenvalues   float32 [L, H, d]     variances along each component, descending
    {kind}.eigenvectors  float32 [L, H, d, d]  column j of [l, h] is component j
    {kind}.ranks         int32   [L, H]        components kept per head, each in [1, d]

A version 2 file holds those eight and exactly two more:

    {kind}.weights       float32 [L, H, d]     effect weight of each component, >= 0: the expected loss
                                               increase (nats per token) per unit of squared error along
                                               it, u_j^T F u_j with F the Fisher matrix E[g g^T] of the
                                               loss gradient w.r.t. the cached vector (`patchkv.fisher`)

Effect weights put the components of every layer, head, key and value in one unit, so a global bit pool
can be allocated over them (`Quantized(pool="global")`).

A version 4 file holds the eight, optionally the two effect weights, and exactly two more, with `B` >= 1
budgets listed in the metadata field `step_budgets`:

    {kind}.step_scales   float32 [B, L, H]     > 0: for budget b, the quantizer steps of head [l, h] (and so its
                                               clipping range) are this multiple of the Gaussian-matched ones
                                               (`patchkv.step_scales.fit_step_scales`; only `Quantized` reads them)

(Version 3, read but no longer written, held one budget, `{kind}.step_scales [L, H]`, whose bits and pool were
recorded in `calibration["step_scales"]`; it loads as a one-budget version 4 artifact when that record names
them, and is refused otherwise.)

A version 5 file holds what a version 1, 2 or 4 file holds (the eight; optionally the effect weights; optionally
the step scales, listed in `step_budgets` exactly when present) and exactly six more, with `D = H * d`, a
layer's KV heads concatenated (head h in columns `h * d : (h + 1) * d`):

    {kind}.layer_mean          float32 [L, D]     mean of each layer's concatenated vectors
    {kind}.layer_eigenvalues   float32 [L, D]     variances along each layer component, descending
    {kind}.layer_eigenvectors  float32 [L, D, D]  column j of [l] is component j of layer l

and, exactly when it holds the effect weights, one more per kind:

    {kind}.layer_weights       float32 [L, D]     effect weight of each layer component, >= 0: u_j^T F u_j with F
                                                  the layer's whole Fisher matrix over its heads concatenated

These are the layer bases that `Quantized(basis="layer")` codes on: one basis per layer shared by its KV heads,
so a token's code for a layer is one latent read by every head (`calibrate(..., layer_bases=True)`). They are
the whole spectrum, as the per-head bases are.

A version 6 file is the artifact of a model with sliding-window layers: it holds the tensors of any version above
(the eight; optionally the effect weights; optionally the step scales, exactly when `step_budgets` is given;
optionally the layer bases, with layer weights exactly when the heads have effect weights) and its `model` object
has a tenth field, `sliding_windows`, that says how many tokens each layer holds (what budgets count bytes by).

A version 7 file holds layer bases that span `S` >= 2 layers each (`calibrate(..., layer_bases=True,
layers_per_basis=S)`): otherwise what a version 5 or 6 file holds (`sliding_windows` allowed), its layer tensors
with one row per span of layers, `G = L / S` rows of width `S * D`. A span is `S` consecutive layers of one attention
kind (`layer_groups`: full attention, or one sliding window; for a model without sliding-window layers, layers
`g * S` to `g * S + S - 1`), `S` dividing the number of layers of each kind; the rows are in the order of the spans'
last layers, and a span's layers are concatenated in order, its `i`-th layer's head h in columns
`i * D + h * d : i * D + (h + 1) * d`:

    {kind}.layer_mean          float32 [G, S * D]
    {kind}.layer_eigenvalues   float32 [G, S * D]
    {kind}.layer_eigenvectors  float32 [G, S * D, S * D]
    {kind}.layer_weights       float32 [G, S * D]     (exactly when the heads have effect weights; F the span's whole
                                                       Fisher matrix, cross-layer terms included)

One latent per token then codes the keys (or values) of `S` layers, what they share coded once (KVTC's bases across
layers). `S` is read from the shapes (`S * D` the width); keys and values span the same layers.

An artifact is written at the lowest version that holds it: 7 with layer bases spanning several layers, else 6 for a
model with sliding-window layers, else 5 with layer bases, else 4 with step scales, else 2 with effect weights, else
1, so files without the newer tensors stay readable by older readers.

Keys are the vectors the cache would hold: un-rotated keys in `pre_rope` mode, rotated keys in
`post_rope` mode. The whole spectrum is stored so that `Artifact.with_ranks` can re-truncate
without recalibrating; only `ranks` components per head are used at inference.

The safetensors header metadata carries one entry, `"patchkv"`, a JSON object with exactly these fields:

    format_version  1, 2, 3, 4, 5, 6 or 7 (see above)
    mode            "pre_rope" | "post_rope"
    model           {"model_type", "architecture", "name_or_path", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                     "dtype"} and, in versions 6 and 7 only, "sliding_windows": one entry per layer, the
                     layer's attention window (a positive integer) or null for full attention, at
                     least one an integer; `apply` refuses a model whose fields differ (name,
                     architecture class and dtype excepted; a model without the field attends
                     fully in every layer)
    calibration     free-form JSON object: source, tokens, sequences, seq_len, sink_tokens,
                    rank selection, the calibration dtype, how the effect weights were measured
                    (`effect_weights`: tokens, window, and `retrieval` {rows, seq, tokens, share}
                    where retrieval rows were mixed in), the step-scale fits; information only,
                    never read to decide how the cache works (a version 3 file's step-scale budget
                    is the one exception: `load` reads it once, into `step_budgets`)
    step_budgets    version 4, and versions 5 to 7 with step scales: [{"bits": int >= 1, "pool": "head" |
                    "global"}, ...], the B distinct budgets (`Quantized(bits, pool)`) the step scales
                    were fitted for
    checksum        "sha256:<hex>" over every tensor (name, dtype, shape, bytes, in name
                    order) and the canonical JSON of the metadata without `checksum`

What is verified
================
`Artifact.load` raises `ArtifactError` (naming the file and, for tensor defects, the tensor, layer and
head) unless all of the following hold, in this order:

1. with `sha256=` given: the sha256 of the file's bytes (what `sha256sum FILE` prints; also
   `patchkv.artifact_format.file_sha256`) equals it, as bare hex or "sha256:<hex>". This is not the stored
   `checksum` field: it covers the whole file, header included. Saved files are byte-for-byte
   reproducible, so the hash of an artifact is stable. The file is read once: the bytes hashed are the
   bytes parsed, so a file replaced meanwhile cannot be loaded under another file's hash.
2. the file is readable safetensors with a `"patchkv"` entry holding a JSON object (not an array, not
   nested deeper than Python can parse), with exactly the fields above;
3. `format_version` is the integer 1, 2, 3, 4, 5, 6 or 7;
4. `checksum` is a "sha256:<64 hex>" string equal to the one recomputed from the tensors and metadata;
5. metadata types: `mode` one of the two strings; `model` an object with exactly the nine fields above (ten in
   version 6), whose `model_type`, `architecture`, `name_or_path` are strings, `num_hidden_layers`,
   `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_size` positive integers, `dtype` one of
   float32, float16, bfloat16, float64, `sliding_windows` a list of `num_hidden_layers` entries, each null or a
   positive integer, at least one an integer, given always in version 6, optionally in 7 and never before;
   `calibration` an object, its objects and
   arrays nested at most 32 deep and its JSON at most 1,000,000 characters (deeper nesting would exhaust Python's
   stack in a copy or pickle later); `step_budgets` (version 4; versions 5 to 7 when present) a non-empty list of
   distinct objects with exactly the fields `bits` (an integer in [1, 8 head_dim]) and `pool` ("head" or "global");
   version 3: `calibration["step_scales"]` an object whose `bits` and `pool` are such a budget;
6. exactly the eight tensors (version 1), ten (version 2), ten or twelve (versions 3 and 4), or the six layer
   tensors, the eight, the effect weights with the two layer weights where present, and the step scales exactly
   when `step_budgets` is given (version 5), or (version 6) the eight with any of those optional sets as in version
   5, or (version 7) the version 5 set, float32 and (ranks) int32, of the shapes above (step scales
   `[B, L, H]` with B the number of budgets; layer tensors of a width `S * D` with `S` >= 2 dividing `L` in version 7,
   `D` before), agreeing with `model`;
7. contents (the same checks run when an `Artifact` is constructed in memory, and before `save`):
   every value finite; ranks in [1, d]; each head's eigenvectors orthonormal,
   max |VᵀV - I| <= 1e-4 (computed in float64); eigenvalues sorted descending and >= 0, where a
   negative value or an increase no larger than 1e-6 x the head's largest eigenvalue is accepted as
   round-off (negatives that small are clamped to 0 in memory; the file is not changed); effect weights,
   where present, >= 0 and given for keys and values both; step scales, where present, > 0 and given for
   keys and values both; layer bases, where present, given for keys and values both and held to the same
   rules as the heads' (finite, eigenvalues sorted and >= 0, each layer's or span's eigenvectors orthonormal), with
   layer weights >= 0 exactly when the heads have effect weights, spanning as many layers for keys as for values.

In memory, `Components` tensors may also be float64 (what `calibrate` produces) and ranks int64; the
file always holds float32 and int32. Loading uses safetensors only: no pickle, no code is executed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: the file an artifact directory (and an artifact repo on the Hub) holds
FILENAME = "patchkv.safetensors"
#: the newest format this version reads and writes (each file is written at the lowest version that holds it)
FORMAT_VERSION = 7
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
MODES = ("pre_rope", "post_rope")
KINDS = ("keys", "values")
#: the fields `apply` checks (dtype is information: bases are cast to the model's dtype at `apply`)
CHECKED_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_size")
STR_FIELDS = ("model_type", "architecture", "name_or_path")
INT_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")
#: exactly the fields of the metadata's `model` object (and, in version 6, `SLIDING_WINDOWS`)
MODEL_FIELDS = (*STR_FIELDS, *INT_FIELDS, "dtype")
#: the model field of a version 6 artifact: each layer's attention window, None for full attention
SLIDING_WINDOWS = "sliding_windows"
META_FIELDS = ("format_version", "mode", "model", "calibration", "checksum")
TENSOR_NAMES = ("mean", "eigenvalues", "eigenvectors", "ranks")
WEIGHTS = "weights"
STEP_SCALES = "step_scales"
STEP_BUDGETS = "step_budgets"
#: the pools a step budget's bits come from (`Quantized(bits, pool)`): "head" (every head's keys and values get the
#: budget) or "global" (one pool over every layer, head, key and value, by effect weight)
POOLS = ("head", "global")
#: the widest code of one component, in bits (a byte): a budget spends at most MAX_BITS x head_dim bits per head
MAX_BITS = 8
#: bounds on the free-form calibration summary (patchkv writes objects and arrays 5 deep, a few KB of JSON): deeper
#: nesting would exhaust Python's stack later, in `copy.deepcopy` (`with_ranks`, `to_dtype`) or pickling
CALIBRATION_MAX_DEPTH = 32
CALIBRATION_MAX_CHARS = 1_000_000
#: the layer bases of a version 5 file, spanning several layers in version 7 (`Components.layer_*`)
LAYER_NAMES = ("layer_mean", "layer_eigenvalues", "layer_eigenvectors")
LAYER_WEIGHTS = "layer_weights"
#: max |VᵀV - I| accepted per head (float32 storage of a float64 eigh is ~1e-7)
ORTHONORMAL_TOL = 1e-4
#: negative eigenvalues and increases up to this share of the head's largest eigenvalue are round-off
EIGENVALUE_RTOL = 1e-6
_SHA256 = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")


def layer_groups(sliding_windows: Sequence[int | None], span: int) -> list[list[int]]:
    """The layers each layer basis spans, one list per row of the layer tensors: `span` consecutive layers of one
    attention kind (`sliding_windows[i]`: layer i's window, None for full attention), in the order of each span's last
    layer. Raises ValueError where `span` does not divide the number of layers of some kind."""
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(sliding_windows):
        kinds.setdefault(window, []).append(i)
    counts = {window: len(layers) for window, layers in kinds.items()}
    if span < 1 or any(n % span for n in counts.values()):
        fits = [s for s in range(1, min(counts.values()) + 1) if all(n % s == 0 for n in counts.values())]
        named = ", ".join(f"{n} {'full-attention' if w is None else f'sliding ({w})'}" for w, n in counts.items())
        raise ValueError(f"layers_per_basis={span}: a basis spans layers of one attention kind, and it must divide "
                         f"the number of layers of each ({named}); pass one of {fits}.")
    spans = [layers[j:j + span] for layers in kinds.values() for j in range(0, len(layers), span)]
    return sorted(spans, key=lambda layers: layers[-1])


def dtype_name(dtype: torch.dtype) -> str:
    """The name the format gives a dtype: "float32" for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, "sha256:<hex>" (the hash `Artifact.load(path, sha256=...)` checks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def parse_sha256(sha256: str | None) -> str | None:
    """An expected file hash, bare hex or "sha256:<hex>", as "sha256:<lowercase hex>"; None stays None."""
    if sha256 is None:
        return None
    m = _SHA256.fullmatch(sha256.strip()) if isinstance(sha256, str) else None
    if not m:
        raise ValueError(f"sha256 must be 64 hex digits, optionally prefixed with 'sha256:', got {sha256!r:.90}.")
    return "sha256:" + m.group(1).lower()


def header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header: 8 bytes little-endian header length, then the JSON
    header. Called after `safetensors.torch.load` has accepted `data`, so the header is well-formed."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("the header's __metadata__ is not an object of strings")
    return metadata


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """The `checksum` field: "sha256:<hex>" over every tensor (name, dtype, shape, bytes, in name order) and the
    canonical JSON of `meta` without `checksum`."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    body = {k: v for k, v in meta.items() if k != "checksum"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return "sha256:" + h.hexdigest()
