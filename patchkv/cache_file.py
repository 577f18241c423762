"""Save and restore a `LatentCache` (a prefix cache that leaves the device), with an optional lossless stage.

    saved = patchkv.save_cache(cache, "prefix.safetensors")   # codes DEFLATE-compressed: saved.code_ratio
    cache = patchkv.load_cache(model, "prefix.safetensors")   # the model patched as when it was written
    out = model(next_ids, cache=cache, use_cache=True)

The cache in memory is fixed-rate: every token's codes take the same bytes, so attention reads the middle in place.
A cache that leaves the device can afford variable-length coding. The quantizer's levels are not equally likely
(a Gaussian-matched 2-bit code carries about 1.9 bits of information; a widened step, `patchkv.step_scales`, makes the
inner levels likelier still), and a dropped-to-zero-bits component costs nothing either way, so DEFLATE (zlib)
over the codes, laid out byte column by byte column (each column holds the same components for every token),
takes back what the fixed rate spends on unlikely levels. Only packed codes (uint8 middles) are compressed; the
exact sinks and window, low-rank latents and positions are stored as they are.

Format (version 6)
==================
One safetensors file. Tensors, for each layer `i` and each region `r` of `patchkv.cache.REGIONS`:

    positions          int32 [batch, seen]      true position of every token (the cache's position track)
    layers.{i}.{r}     the region as held       encoding "raw" (the salient regions of a `Salience` method:
                                                key and value copies (exact, or int8 / int4 with their
                                                float32 scales in `salient_scale`, width 2; int4 two to a
                                                byte, uint8 `[..., head_dim / 2]`; width 0 for exact
                                                copies), int32 coded index (over the middle, then the near
                                                tokens), float32 score, each `[batch, kv_heads, s, ...]`;
                                                zero-sized without one; the near
                                                regions of `NearCodes`, zero-sized without it; the window
                                                exact, or int8 / int4 with its float32 scales in `recent_scale`,
                                                `[batch, kv_heads, window, 2]`, width 0 for an exact window; the
                                                kept-token bitmap of `Evict`, uint8 `[batch, 1, bytes, 1]`, bit i
                                                of byte i // 8 (low bit first) set where the i-th token to leave
                                                the window is held, zero bytes without it; under a basis
                                                across layers only a span's last layer holds the span's
                                                middle, the others an empty one)
    layers.{i}.{r}     uint8 [n]                encoding "deflate": the zlib stream of the region's uint8 bytes
                                                `[batch, 1, seq, width]` laid out as `[batch, width, seq]`

The header metadata has one entry, `"patchkv_cache"`, a JSON object: `format_version` 6; `fingerprint`, the
patch's (artifact checksum and methods); `layers`, one object per layer with `cumulative_length` (tokens seen)
and `regions`: per region its `shape`, `dtype`, `encoding`, and for "deflate" the `crc32` of the raw bytes; under
`Evict`, `pending` (int, 0 when absent): how many of the last tokens to leave the window are coded and not yet ranked
(they left in groups under the method's `block`; all held).

`load_cache` reads tensors and JSON only (nothing is executed) and checks the whole file against the model's patch
from its header before it reads a tensor; it raises `PatchKVError` naming what differs (what it found, what the
patch holds) unless: the entry is there at version 6 (5, written before eviction existed: every token held; 4,
before int8 windows existed too: its window exact; 3, before int8 salient
copies existed too: its copies exact; 2, before the near regions too; 1, before the salient regions too: read with none); the fingerprint is the model's patch's (the same artifact and methods); the layer count is the patch's; every
layer holds all its regions (or none does, for an empty cache) and all have seen the same number of tokens, which is
the length of the int32 position track `[batch, seen]`; every region is present with its declared shape and dtype,
and those are what the layer's patch holds: exact regions in the patch's dtype `[batch, kv_heads, n, head_dim]`, the
middle and the near tokens in their codecs' stored dtype and width `[batch, 1, m, width]`, salient copies and the window in the
patch's dtype (or int8, or int4 two to a byte, with 2 scales: `patchkv.methods.base.copy_layout`), salient indices
int32 and scores float32, one
batch throughout; keys and values of a region hold as many tokens, and the counts are what the layer keeps (its
sinks, at most `window` recent and `near_tokens` near tokens, every token seen in a full layer and at least the last `sliding_window - 1`
in a sliding one, salient copies only under a salience method and no more than the middle; under `Evict` a full
layer holds the sinks, the window and the bitmap's set bits, its bitmap as many bytes as the tokens that left the
window need and no bit set past them, and without it every token and an empty bitmap; a layer of a basis across
layers the middle its span's last layer holds, none of its own); salient indices point
into the middle; every true position lies in [0, limit), limit the model's `max_position_embeddings` or, past it,
the tokens seen; deflated regions inflate to exactly their declared bytes with their crc32.

Nothing is allocated beyond what the file vouches for: tensors are read only once the header checks pass (each at
most the file's size), and a deflated region inflates to at most its declared bytes, `batch * m * width` from
the checked layout (`batch` and `m` bounded by the position track stored in the file, `width` the codec's), so
a stream that would inflate further (a DEFLATE bomb) stops there and is refused.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .cache import (KEPT, NEAR, REGIONS, SALIENT, WINDOW_SCALE, LatentCache, LatentLayer, no_kept, no_near, no_salient,
                    no_window_scale, unpack_bits)
from .errors import PatchKVError
from .lossless import InflateError, check_compress, deflate, inflate
from .methods.base import copy_layout

FORMAT = "patchkv_cache"
VERSION = 6
#: versions load_cache reads: 5 has no kept-token bitmap (every token held), 4 no window scales either (an exact
#: window), 3 no salient scales either (exact copies), 2 no near regions either, 1 no salient regions either
READABLE = (1, 2, 3, 4, 5, 6)
ENCODINGS = ("raw", "deflate")
#: the dtypes a region may be stored in, by their names in the metadata and in the safetensors header
_SAFETENSORS = {torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16", torch.float64: "F64"}
_DTYPES = {str(d).removeprefix("torch."): d for d in _SAFETENSORS}
#: a file's tensors by name: (shape, safetensors dtype), as its header declares them
Header = dict[str, tuple[tuple[int, ...], str]]


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
    check_compress(compress, level)
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
            coded = name.startswith(("latent", "near")) and t.dtype == torch.uint8
            if compress and coded and t.numel():
                raw = t.squeeze(1).transpose(1, 2).contiguous().numpy().tobytes()  # [batch, width, seq]
                packed = deflate(raw, level)
                code_bytes, stored = code_bytes + len(raw), stored + len(packed)
                entry.update(encoding="deflate", crc32=zlib.crc32(raw))
                t = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            elif coded:
                code_bytes, stored = code_bytes + t.nbytes, stored + t.nbytes
            tensors[f"layers.{i}.{name}"] = t
            regions[name] = entry
        layers.append({"cumulative_length": layer.cumulative_length, "regions": regions,
                       **({"pending": layer.pending} if layer.pending else {})})
    meta = {"format_version": VERSION, "fingerprint": cache.fingerprint, "layers": layers}
    path = Path(path)
    save_file(tensors, str(path), metadata={FORMAT: json.dumps(meta)})
    return SavedCache(path, cache.nbytes(), code_bytes, stored)


def load_cache(model: torch.nn.Module, path: str | Path, *, device: torch.device | str | None = None
               ) -> LatentCache:
    """A `LatentCache` for the patched `model` holding what `save_cache` wrote to `path`, on `device` (default: the
    model's). Raises `PatchKVError` (see the module doc) if the file is not a patchkv cache file, was written under
    another patch, or does not describe a cache of this patch; the whole file is checked from its header before any
    tensor is read."""
    path = Path(path)
    cache = LatentCache(model)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _metadata(path, (f.metadata() or {}).get(FORMAT))
            _check_patch(path, meta, cache)
            names = _check_layout(path, meta, cache, _header(f))
            tensors = {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as e:
        raise PatchKVError(f"{path}: not a readable patchkv cache file ({' '.join(str(e).split())}).") from e
    if "positions" in tensors:
        _check_positions(path, model, tensors["positions"])
    device = torch.device(device) if device is not None else next(model.parameters()).device
    for i, (layer, entry) in enumerate(zip(cache.layers, meta["layers"])):
        regions = entry["regions"]
        if not regions:
            continue
        held = {name: _region(path, tensors, f"layers.{i}.{name}", regions[name]) for name in regions}
        held.update(_salient(path, i, held))
        if WINDOW_SCALE not in held:  # before version 5: an exact window
            held.update(no_window_scale(held["recent_keys"]))
        if "near_keys" not in held:
            held.update(no_near(layer.patch, held["sink_keys"], held["sink_values"]))
        held.update(_kept(path, i, held, entry["cumulative_length"], entry.get("pending", 0)))
        layer.tensors = {name: t.to(device) for name, t in held.items()}
        layer.pending = entry.get("pending", 0)
        layer.cumulative_length, layer.device, layer.is_initialized = entry["cumulative_length"], device, True
    if "positions" in tensors:
        cache.track.positions = tensors["positions"].to(device)
    return cache


def _check_positions(path: Path, model: torch.nn.Module, positions: torch.Tensor) -> None:
    """Every true position in `positions` `[batch, seen]` lies in [0, limit), limit the model's
    `max_position_embeddings` or, past it, the tokens seen: the next forward builds a RoPE table up to the highest
    position (2^31 - 1 would make it 16 GiB), and a negative one would index it from the end."""
    seen = positions.shape[1]
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 0
    limit = max(context, seen)
    if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < limit):
        raise _damaged(path, f"its position track holds positions {int(positions.min())} to {int(positions.max())}; "
                             f"a cache of {seen} tokens for this model (max_position_embeddings {context or 'unset'}) "
                             f"holds positions in [0, {limit})")


def _header(f) -> Header:
    """Each tensor's shape and safetensors dtype ("U8", "I32", ...) in the open file `f`, from its header only."""
    slices = {name: f.get_slice(name) for name in f.keys()}
    return {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}


def _check_patch(path: Path, meta: dict, cache: LatentCache) -> None:
    """The file was written under the patch `cache` belongs to (same fingerprint, same layer count)."""
    if meta["fingerprint"] != cache.fingerprint:
        raise PatchKVError(f"{path} was written under another patch (fingerprint {meta['fingerprint']}, this model's "
                           f"is {cache.fingerprint}): load it into the model patched with the same artifact and "
                           "methods it was saved under.")
    if len(meta["layers"]) != len(cache.layers):
        raise PatchKVError(f"{path} holds {len(meta['layers'])} layers, this model's patch has {len(cache.layers)}.")


def _damaged(path: Path, what: str) -> PatchKVError:
    return PatchKVError(f"{path}: {what}. The file is damaged or was edited after patchkv.save_cache wrote it; save "
                        "the cache again.")


def _check_layout(path: Path, meta: dict, cache: LatentCache, stored: Header) -> list[str]:
    """The file as a whole, from its header (`stored`: each tensor's shape and safetensors dtype), against the patch:
    every layer holds its regions or none does, all have seen the same tokens, the position track is int32 `[batch,
    seen]`, and each layer's regions are what its codecs, mode and methods hold (`_check_layer`). Returns the
    tensors to read."""
    layers = meta["layers"]
    filled = [i for i, entry in enumerate(layers) if entry["regions"]]
    lengths = [entry["cumulative_length"] for entry in layers]
    if not filled:
        if any(lengths):
            raise _damaged(path, f"its layers hold no regions but say they have seen {max(lengths)} tokens")
        return []
    if len(filled) != len(layers):
        empty = sorted(set(range(len(layers))) - set(filled))
        raise _damaged(path, f"layers {empty} hold no regions while layers {filled} do (every layer of a cache sees "
                             "every token)")
    if len(set(lengths)) != 1:
        raise _damaged(path, f"its layers disagree on the tokens seen (cumulative_length {lengths}; every layer of a "
                             "cache sees every token)")
    shape, dtype = stored.get("positions", ((), "missing"))
    if len(shape) != 2 or shape[1] != lengths[0] or dtype != "I32":
        raise _damaged(path, f"its position track is {dtype} {list(shape)}, expected I32 (int32) [batch, "
                             f"{lengths[0]}]: one true position per token its layers have seen")
    names, middles = ["positions"], {}
    for i in reversed(range(len(layers))):  # a span's last layer, which holds its middle, before the span's others
        layer = cache.layers[i]
        span = None if layer.owner is None else middles[cache.layers.index(layer.owner)]
        names += _check_layer(path, i, layer, layers[i], stored, shape[0], meta["format_version"], span)
        middles[i] = layers[i]["regions"]["latent_keys"]["shape"][2]
    return names


def _check_layer(path: Path, i: int, layer: LatentLayer, entry: dict, stored: Header, batch: int, version: int,
                 span: int | None = None) -> list[str]:
    """Layer `i`'s entry and stored regions against its patch: every region there, each region's dtype and `[batch,
    heads, tokens, width]` those of its codecs and mode, keys and values of a region as many tokens, and the token
    counts those the layer keeps: its sinks, at most `window` recent tokens, every token seen in a full layer (at
    least the last `sliding_window - 1` in a sliding one), exact copies of middle tokens only with a salience
    method; a layer of a basis across layers (`LatentLayer.owner`) none of its own, its span's middle of `span`
    tokens held by the span's last layer. Returns the tensor names."""
    regions = entry["regions"]
    missing = {6: (), 5: (KEPT,), 4: (WINDOW_SCALE, KEPT), 3: ("salient_scale", WINDOW_SCALE, KEPT),
               2: (*NEAR, "salient_scale", WINDOW_SCALE, KEPT),
               1: (*NEAR, *SALIENT, WINDOW_SCALE, KEPT)}[version]  # regions a file of that version was written without
    expected = tuple(r for r in REGIONS if r not in missing)
    if set(regions) != set(expected):
        raise _damaged(path, f"layer {i} holds regions {sorted(regions)}, expected {list(expected)}")
    for name in expected:
        _check_entry(path, f"layers.{i}.{name}", regions[name], stored)
    patterns = _patterns(layer, batch)
    for name in expected:
        shape, dtype = regions[name]["shape"], _DTYPES[regions[name]["dtype"]]
        want_dtype, (b, heads, width), what = patterns[name]
        if dtype != want_dtype or (shape[0], shape[1], shape[3]) != (b, heads, width):
            raise _damaged(path, f"region layers.{i}.{name} is {dtype} {shape}, this patch's layer {i} holds {what} "
                                 f"there as {want_dtype} [{b}, {heads}, tokens, {width}]")
    tokens = {name: regions[name]["shape"][2] for name in expected}
    for group in (("sink_keys", "sink_values"), ("latent_keys", "latent_values"),
                  tuple(n for n in ("recent_keys", "recent_values", WINDOW_SCALE) if n in tokens),
                  tuple(n for n in SALIENT if n in tokens), tuple(n for n in NEAR if n in tokens)):
        if len({tokens[n] for n in group}) > 1:
            raise _damaged(path, f"layer {i}'s regions {list(group)} hold different numbers of tokens "
                                 f"{[tokens[n] for n in group]}")
    if span is not None:
        if tokens["latent_keys"]:
            raise _damaged(path, f"layer {i} holds a middle of {tokens['latent_keys']} tokens, and its codes are its "
                                 "span's, held by the span's last layer")
        tokens["latent_keys"] = span
    _check_counts(path, i, layer, entry["cumulative_length"], tokens)
    return [f"layers.{i}.{name}" for name in expected]


def _patterns(layer: LatentLayer, batch: int) -> dict[str, tuple[torch.dtype, tuple[int, int, int], str]]:
    """Each region's dtype, `(batch, heads, width)` (its shape but the token axis) and what it is, under `layer`'s
    patch: exact regions in the model's dtype `[batch, kv_heads, tokens, head_dim]` (salient copies and the window
    as `copy_layout` holds their bits, with their scales), the middle as its codecs store it `[batch, 1, tokens,
    width]`, salient indices int32 and scores float32 `[batch, kv_heads, tokens, 1]`."""
    lp = layer.patch
    dtype, heads = lp.patch.dtype, lp.keys.basis.heads
    exact = {kind: (dtype, (batch, heads, getattr(lp, kind).basis.head_dim), f"exact {kind}")
             for kind in ("keys", "values")}
    patterns = {f"sink_{kind}": exact[kind] for kind in exact}
    copied = 16 if layer.salience is None else layer.salience.bits
    for region, bits in (("salient", copied), ("recent", layer.window_bits)):
        for kind in ("keys", "values"):
            held, width, scales = copy_layout(bits, dtype, exact[kind][1][2])
            patterns[f"{region}_{kind}"] = (held, (batch, heads, width), f"{'exact' if bits == 16 else f'int{bits}'} "
                                                                         f"{region} {kind}")
        patterns[f"{region}_scale"] = (torch.float32, (batch, heads, scales), f"the {region} tokens' scales")
    for kind in ("keys", "values"):
        for region, codec in (("latent", getattr(lp, kind)), ("near", getattr(lp, f"near_{kind}"))):
            patterns[f"{region}_{kind}"] = (codec.stored_dtype, (batch, 1, codec.width),
                                            f"the {kind}' {codec.describe()}")
    patterns["salient_index"] = (torch.int32, (batch, heads, 1), "salient coded indices")
    patterns["salient_score"] = (torch.float32, (batch, heads, 1), "salient scores")
    patterns[KEPT] = (torch.uint8, (batch, 1, 1), "the kept-token bitmap")
    return patterns


def _check_counts(path: Path, i: int, layer: LatentLayer, seen: int, tokens: dict[str, int]) -> None:
    """Layer `i`'s token counts (`tokens`: each region's) are what it keeps after `seen` tokens (see `_check_layer`)."""
    sinks, middle, recent = tokens["sink_keys"], tokens["latent_keys"], tokens["recent_keys"]
    salient, near = tokens.get("salient_keys", 0), tokens.get("near_keys", 0)
    kept = sinks + middle + near + recent
    if layer.is_sliding:
        held = f"at least {min(seen, layer.sliding_window - 1)} and at most {seen} tokens (sliding window " \
               f"{layer.sliding_window}), at most {min(layer.sink_tokens, seen)} sinks"
        ok = sinks <= min(layer.sink_tokens, seen) and min(seen, layer.sliding_window - 1) <= kept <= seen
    elif layer.evict is not None:
        passed = seen - sinks - recent
        held = f"{min(layer.sink_tokens, seen)} sinks and at most the {passed} tokens that left the window of " \
               f"{seen}, a bitmap of {-(-passed // 8)} bytes"
        ok = sinks == min(layer.sink_tokens, seen) and middle + near <= passed and \
            tokens.get(KEPT, 0) == -(-passed // 8)
    else:
        held = f"all {seen} tokens, {min(layer.sink_tokens, seen)} of them sinks, no bitmap"
        ok = sinks == min(layer.sink_tokens, seen) and kept == seen and not tokens.get(KEPT, 0)
    capacity = "none" if layer.salience is None else f"at most the {middle + near} coded tokens"
    if not ok or recent > layer.window or near > layer.near_tokens or \
            salient > (0 if layer.salience is None else middle + near):
        raise _damaged(path, f"layer {i} holds {sinks} sinks, {middle} middle, {near} near, {recent} recent and "
                             f"{salient} salient tokens and a bitmap of {tokens.get(KEPT, 0)} bytes after {seen} seen; under this patch it holds {held}, at most "
                             f"{layer.window} recent and {layer.near_tokens} near, salient copies: {capacity}")


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
            and isinstance(e.get("regions"), dict) and type(e.get("pending", 0)) is int and e.get("pending", 0) >= 0
            for e in meta["layers"]):
        raise PatchKVError(f"{path}: its metadata needs a string 'fingerprint' and 'layers' as objects with "
                           "'cumulative_length' (int >= 0), 'regions' and, if any, 'pending' (int >= 0).")
    return meta


def _salient(path: Path, i: int, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer `i`'s salient regions (shapes checked by `_check_layout`), each KV head's indices inside the coded tokens
    (middle, then near); empty ones for a version 1 file."""
    if "salient_keys" not in held:
        return no_salient(held["sink_keys"], held["sink_values"])
    if "salient_scale" not in held:  # version 3: exact copies
        held["salient_scale"] = held["salient_index"].new_zeros((*held["salient_index"].shape[:3], 0),
                                                                dtype=torch.float32)
    index = held["salient_index"]
    coded = held["latent_keys"].shape[2] + (held["near_keys"].shape[2] if "near_keys" in held else 0)
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < coded):
        raise _damaged(path, f"layer {i}'s salient regions point at coded tokens {int(index.min())} to "
                             f"{int(index.max())}, its middle and near regions hold {coded}")
    return {name: held[name] for name in SALIENT}


def _kept(path: Path, i: int, held: dict[str, torch.Tensor], seen: int, pending: int) -> dict[str, torch.Tensor]:
    """Layer `i`'s kept-token bitmap (its bytes checked by `_check_layout`): as many bits set in each sequence as the
    coded tokens it holds, none past the tokens that left the window, and the last `pending` of those held; an empty
    one (and none pending) for a file written before version 6."""
    bitmap = held[KEPT] if KEPT in held else no_kept(held["sink_keys"])[KEPT]
    passed = seen - held["sink_keys"].shape[2] - held["recent_keys"].shape[2]
    bits = unpack_bits(bitmap, bitmap.shape[2] * 8)
    coded = held["latent_keys"].shape[2] + held["near_keys"].shape[2]
    if bitmap.shape[2] and (bits[:, passed:].any() or bool((bits.sum(1) != coded).any())):
        raise _damaged(path, f"layer {i}'s bitmap marks {bits[:, :passed].sum(1).tolist()} of the {passed} tokens that "
                             f"left the window held ({int(bits[:, passed:].sum())} bits set past them), its middle and "
                             f"near regions hold {coded}")
    last_held = pending <= min(passed, coded) and bool(bits[:, max(0, passed - pending):passed].all())
    if pending and not (bitmap.shape[2] and last_held):
        raise _damaged(path, f"layer {i} has {pending} tokens pending, but its bitmap does not hold the last {pending} "
                             f"of the {passed} tokens that left the window (its middle and near regions hold {coded})")
    return {KEPT: bitmap}


def _check_entry(path: Path, name: str, entry: dict, stored: Header) -> None:
    """Region `name`'s entry is well formed and the file's tensor is what it says: the region as is ("raw") or a 1-d
    uint8 stream of uint8 codes ("deflate")."""
    shape, dtype, encoding = entry.get("shape"), _DTYPES.get(entry.get("dtype")), entry.get("encoding")
    if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(s, int) and s >= 0 for s in shape)) \
            or dtype is None or encoding not in ENCODINGS or name not in stored:
        raise _damaged(path, f"region {name} is missing or its entry is malformed (shape {shape}, dtype "
                             f"{entry.get('dtype')}, encoding {encoding})")
    found, kind = stored[name]
    if encoding == "raw" and (list(found) != shape or kind != _SAFETENSORS[dtype]):
        raise _damaged(path, f"region {name} is {kind} {list(found)}, its entry says {_SAFETENSORS[dtype]} {shape}")
    if encoding == "deflate" and (dtype != torch.uint8 or kind != "U8" or len(found) != 1):
        raise _damaged(path, f"region {name} is deflated, so it must be uint8 codes stored as a 1-d uint8 stream "
                             f"(found {entry.get('dtype')} codes stored as {kind} {list(found)})")


def _region(path: Path, tensors: dict[str, torch.Tensor], name: str, entry: dict) -> torch.Tensor:
    """The region `name` as held (its entry checked by `_check_entry`), inflated when deflated."""
    t = tensors[name]
    if entry["encoding"] == "raw":
        return t
    batch, _, seq, width = entry["shape"]
    try:  # at most the declared bytes come out (checked against the patch): a stream that would inflate further stops
        raw = inflate(t.numpy().tobytes(), batch * seq * width)
    except InflateError as e:
        raise PatchKVError(f"{path}: region {name} {e}; the file is damaged.") from e
    if zlib.crc32(raw) != entry.get("crc32"):
        raise PatchKVError(f"{path}: region {name} inflates to other bytes than were saved (crc32 differs); "
                           "the file is damaged.")
    codes = np.frombuffer(raw, dtype=np.uint8).reshape(batch, width, seq).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(codes)).unsqueeze(1)
