"""Save and restore a `LatentCache` (a prefix cache that leaves the device), with an optional lossless stage.

    saved = patchkv.save_cache(cache, "prefix.safetensors")   # codes DEFLATE-compressed: saved.code_ratio
    cache = patchkv.load_cache(model, "prefix.safetensors")   # the model patched as when it was written
    out = model(next_ids, cache=cache, use_cache=True)

The cache in memory is fixed-rate: every token's codes take the same bytes, so attention reads the middle in place.
A cache that leaves the device can afford variable-length coding. The quantizer's levels are not equally likely
(a Gaussian-matched 2-bit code carries about 1.9 bits of information; a widened step, `patchkv.steps`, makes the
inner levels likelier still), and a dropped-to-zero-bits component costs nothing either way, so DEFLATE (zlib)
over the codes, laid out byte column by byte column (each column holds the same components for every token),
takes back what the fixed rate spends on unlikely levels. Only packed codes (uint8 middles) are compressed; the
exact sinks and window, low-rank latents and positions are stored as they are.

Format (version 2)
==================
One safetensors file. Tensors, for each layer `i` and each region `r` of `patchkv.cache.REGIONS`:

    positions          int32 [batch, seen]      true position of every token (the cache's position track)
    layers.{i}.{r}     the region as held       encoding "raw" (the salient regions of a `Salience` method:
                                                exact keys and values, int32 middle index, float32 score, each
                                                `[batch, kv_heads, s, ...]`; zero-sized without one)
    layers.{i}.{r}     uint8 [n]                encoding "deflate": the zlib stream of the region's uint8 bytes
                                                `[batch, 1, seq, width]` laid out as `[batch, width, seq]`

The header metadata has one entry, `"patchkv_cache"`, a JSON object: `format_version` 2; `fingerprint`, the
patch's (artifact checksum and methods); `layers`, one object per layer with `cumulative_length` (tokens seen)
and `regions`: per region its `shape`, `dtype`, `encoding`, and for "deflate" the `crc32` of the raw bytes.

`load_cache` reads tensors and JSON only (nothing is executed) and raises `PatchKVError` naming what differs
unless: the entry is there at version 2 (or 1, written before the salient regions existed: read with none); the
fingerprint is the model's patch's (the same artifact and methods); the layer count is the patch's; every region is
present with its declared shape and dtype, each layer's regions agree on the batch and hold at most the tokens it
has seen, its salient regions agree on their count and point into its middle, and the position track covers every
layer; deflated regions inflate to exactly their declared bytes with their crc32.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .cache import REGIONS, SALIENT, LatentCache, no_salient
from .errors import PatchKVError

FORMAT = "patchkv_cache"
VERSION = 2
#: versions load_cache reads: 1 has no salient regions
READABLE = (1, 2)
ENCODINGS = ("raw", "deflate")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int32, torch.float32, torch.float16,
                                                      torch.bfloat16, torch.float64)}


@dataclass(frozen=True)
class SavedCache:
    """What `save_cache` wrote: the file, the bytes the cache holds in memory (`LatentCache.nbytes`), and the
    middle's codes before and after the lossless stage (`code_ratio` = raw / stored; 1.0 with `compress=None`)."""

    path: Path
    held_bytes: int
    code_bytes: int
    stored_code_bytes: int

    @property
    def code_ratio(self) -> float:
        return self.code_bytes / self.stored_code_bytes if self.stored_code_bytes else 1.0


def save_cache(cache: LatentCache, path: str | Path, *, compress: str | None = "deflate", level: int = 6
               ) -> SavedCache:
    """Write `cache` to `path` (format above), its packed codes DEFLATE-compressed at zlib `level` unless
    `compress` is None. The cache is not changed; tensors are copied to the CPU."""
    if compress not in (None, "deflate"):
        raise ValueError(f"compress must be 'deflate' or None, got {compress!r}.")
    if not isinstance(cache, LatentCache):
        raise PatchKVError(f"save_cache() writes a patchkv.LatentCache, got {type(cache).__name__}; a patched "
                           "model's generate() or patchkv.LatentCache(model) makes one.")
    tensors: dict[str, torch.Tensor] = {}
    layers, code_bytes, stored = [], 0, 0
    if cache.track.positions is not None:
        tensors["positions"] = cache.track.positions.cpu().contiguous()
    for i, layer in enumerate(cache.layers):
        regions = {}
        for name in REGIONS if layer.is_initialized else ():
            t = layer.tensors[name].detach().cpu().contiguous()
            entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "encoding": "raw"}
            if compress and name.startswith("latent") and t.dtype == torch.uint8 and t.numel():
                raw = t.squeeze(1).transpose(1, 2).contiguous().numpy().tobytes()  # [batch, width, seq]
                packed = zlib.compress(raw, level)
                code_bytes, stored = code_bytes + len(raw), stored + len(packed)
                entry.update(encoding="deflate", crc32=zlib.crc32(raw))
                t = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            elif name.startswith("latent") and t.dtype == torch.uint8:
                code_bytes, stored = code_bytes + t.nbytes, stored + t.nbytes
            tensors[f"layers.{i}.{name}"] = t
            regions[name] = entry
        layers.append({"cumulative_length": layer.cumulative_length, "regions": regions})
    meta = {"format_version": VERSION, "fingerprint": cache.fingerprint, "layers": layers}
    path = Path(path)
    save_file(tensors, str(path), metadata={FORMAT: json.dumps(meta)})
    return SavedCache(path, cache.nbytes(), code_bytes, stored)


def load_cache(model: torch.nn.Module, path: str | Path, *, device: torch.device | str | None = None
               ) -> LatentCache:
    """A `LatentCache` for the patched `model` holding what `save_cache` wrote to `path`, on `device` (default: the
    model's). Raises `PatchKVError` (see the module doc) if the file is not a patchkv cache file or was written
    under another patch."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _metadata(path, (f.metadata() or {}).get(FORMAT))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PatchKVError(f"{path}: not a readable patchkv cache file ({' '.join(str(e).split())}).") from e
    cache = LatentCache(model)
    if meta["fingerprint"] != cache.fingerprint:
        raise PatchKVError(f"{path} was written under another patch (fingerprint {meta['fingerprint']}, this model's "
                           f"is {cache.fingerprint}): load it into the model patched with the same artifact and "
                           "methods it was saved under.")
    if len(meta["layers"]) != len(cache.layers):
        raise PatchKVError(f"{path} holds {len(meta['layers'])} layers, this model's patch has {len(cache.layers)}.")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    seen, batch = 0, None
    for i, (layer, entry) in enumerate(zip(cache.layers, meta["layers"])):
        regions = entry.get("regions")
        if not regions:
            continue
        expected = REGIONS if meta["format_version"] == 2 else tuple(r for r in REGIONS if r not in SALIENT)
        if set(regions) != set(expected):
            raise PatchKVError(f"{path}: layer {i} holds regions {sorted(regions)}, expected {list(expected)}.")
        held = {name: _region(path, tensors, f"layers.{i}.{name}", regions[name]) for name in expected}
        if len({t.shape[0] for t in held.values()}) != 1 or \
                sum(held[n].shape[2] for n in ("sink_keys", "latent_keys", "recent_keys")) > entry["cumulative_length"]:
            raise PatchKVError(f"{path}: layer {i}'s regions disagree on the batch or hold more tokens than the "
                               f"{entry['cumulative_length']} it has seen.")
        held.update(_salient(path, i, held))
        batch = held["sink_keys"].shape[0]
        layer.tensors = {name: t.to(device) for name, t in held.items()}
        layer.cumulative_length, layer.device, layer.is_initialized = entry["cumulative_length"], device, True
        seen = max(seen, layer.cumulative_length)
    if seen:
        positions = tensors.get("positions")
        if positions is None or positions.dim() != 2 or positions.shape[0] != batch or positions.shape[1] < seen:
            raise PatchKVError(f"{path}: the position track does not cover the batch of {batch} and the {seen} tokens "
                               "its layers have seen.")
        cache.track.positions = positions.to(device, torch.int32)
    return cache


def _metadata(path: Path, text: str | None) -> dict:
    if text is None:
        raise PatchKVError(f"{path} has no {FORMAT!r} metadata: not written by patchkv.save_cache.")
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise PatchKVError(f"{path}: its {FORMAT!r} metadata is not valid JSON ({e}).") from e
    if not isinstance(meta, dict) or meta.get("format_version") not in READABLE:
        found = meta.get("format_version") if isinstance(meta, dict) else type(meta).__name__
        raise PatchKVError(f"{path}: cache file format version {found!r}, this patchkv reads version {VERSION}; "
                           "save the cache again with this version.")
    if not isinstance(meta.get("fingerprint"), str) or not isinstance(meta.get("layers"), list) or not all(
            isinstance(e, dict) and isinstance(e.get("cumulative_length"), int) and e["cumulative_length"] >= 0
            and isinstance(e.get("regions"), dict) for e in meta["layers"]):
        raise PatchKVError(f"{path}: its metadata needs a string 'fingerprint' and 'layers' as objects with "
                           "'cumulative_length' (int >= 0) and 'regions'.")
    return meta


def _salient(path: Path, i: int, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer `i`'s salient regions, checked: as many exact keys, values, indices and scores, each KV head's
    indices inside the middle; empty ones for a version 1 file."""
    keys = held["sink_keys"]
    if "salient_keys" not in held:
        return no_salient(keys, held["sink_values"])
    sal = {name: held[name] for name in SALIENT}
    shapes = {name: tuple(t.shape) for name, t in sal.items()}
    count = sal["salient_keys"].shape[:3]
    index = sal["salient_index"]
    if any(t.shape[:3] != count for t in sal.values()) or sal["salient_keys"].shape != sal["salient_values"].shape \
            or count[:2] != keys.shape[:2] or index.shape[3] != 1 or sal["salient_score"].shape[3] != 1 \
            or index.dtype != torch.int32 or sal["salient_score"].dtype != torch.float32 \
            or (index.numel() and not (0 <= int(index.min()) and int(index.max()) < held["latent_keys"].shape[2])):
        raise PatchKVError(f"{path}: layer {i}'s salient regions {shapes} do not describe exact copies of its middle "
                           f"tokens (one int32 index into the {held['latent_keys'].shape[2]} middle tokens and one "
                           "float32 score each); the file is damaged.")
    return sal


def _region(path: Path, tensors: dict[str, torch.Tensor], name: str, entry: dict) -> torch.Tensor:
    """The region `name` as held, checked against its entry (and inflated when deflated)."""
    shape, dtype, encoding = entry.get("shape"), _DTYPES.get(entry.get("dtype")), entry.get("encoding")
    if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(s, int) and s >= 0 for s in shape)) \
            or dtype is None or encoding not in ENCODINGS or name not in tensors:
        raise PatchKVError(f"{path}: region {name} is missing or its entry is malformed (shape {shape}, dtype "
                           f"{entry.get('dtype')}, encoding {encoding}).")
    t = tensors[name]
    if encoding == "raw":
        if list(t.shape) != shape or t.dtype != dtype:
            raise PatchKVError(f"{path}: region {name} is {t.dtype} {list(t.shape)}, its entry says {dtype} {shape}.")
        return t
    batch, _, seq, width = shape
    expected = batch * seq * width
    if dtype != torch.uint8 or t.dtype != torch.uint8 or t.dim() != 1:
        raise PatchKVError(f"{path}: region {name} is deflated, so it must be uint8 codes stored as a 1-d stream.")
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(t.numpy().tobytes(), expected)
    except zlib.error as e:
        raise PatchKVError(f"{path}: region {name} does not inflate ({e}); the file is damaged.") from e
    if len(raw) != expected or inflater.unconsumed_tail or not inflater.eof or zlib.crc32(raw) != entry.get("crc32"):
        raise PatchKVError(f"{path}: region {name} inflates to other bytes than were saved (size or crc32 differ); "
                           "the file is damaged.")
    codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(batch, width, seq)
    return codes.transpose(1, 2).contiguous().unsqueeze(1)
