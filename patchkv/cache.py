"""`LatentCache`: the `transformers` cache of a patched model, one `LatentLayer` per attention layer.

Each layer holds, in position order (keys in the space the mode's basis describes: un-rotated in
pre-RoPE mode, rotated in post-RoPE mode):

    sink_keys, sink_values       [batch, kv_heads, sinks, head_dim]    exact
    latent_keys, latent_values   [batch, 1, middle, width]             the codec's latents or codes
    near_keys, near_values       [batch, 1, near, near width]          the newest codes, at the near rate
    recent_keys, recent_values   [batch, kv_heads, window, head_dim]   exact, or int8 / int4 between forwards
    recent_scale                 [batch, kv_heads, window, 2 or 0]     an int8 / int4 window's scales (float32)
    salient_keys, salient_values [batch, kv_heads, s, head_dim]        copies of coded tokens (Salience), 16/8/4 bits
    salient_index, salient_score [batch, kv_heads, s, 1]               their coded index (int32), score (float32)
    salient_scale                [batch, kv_heads, s, 2 or 0]          int8 / int4 copies' scales (float32)
    evict_kept                   [batch, 1, bytes, 1]                  which tokens that left the window are held
                                                                       (Evict), a bitmap, 8 tokens a byte (uint8)

int4 copies and windows are stored two to a byte, `[..., head_dim / 2]` uint8 (`methods.base.copy_layout`).

These are the stored names (`patchkv.cache_file` writes them): `latent_*` hold the middle, `recent_*` the window
(the regions' words are sinks, middle, near and window; the stored names stay as cache files hold them).

Unused regions are zero-sized, so there is one layout and one code path. A plan with `NearCodes` keeps the last
`near_tokens` tokens to leave the window in the near region, coded by the layer's near codecs at a higher rate;
older ones move on into the middle, coded again at its rate (decoded, then encoded), `near_block` or more at a
time. A plan with `Evict` drops the tokens its score ranks lowest as they leave the window, before they are coded
(those leaving in groups under its `block`, decode steps, are coded and ranked from their codes once `block` have
gathered: `pending` counts them); each full-attention layer keeps a bitmap over the tokens that have left its window
(bit `i` of byte `i // 8`, low bit first, set where the token is held), from which the held coded tokens' true
positions and mask columns are read (`Visible.columns`). A plan with a `Salience` method keeps, per KV head, the coded
tokens (middle and near) it scores highest exact as well (scored as they leave the window, the best `capacity(coded)` so far, indexed in position order over the middle
then the near tokens, an index a token keeps as it moves from one to the other); attention reads those in place of
their codes (`patchkv.operands.dense`, and the decode step's exact tokens). A forward's own tokens are read exact, as
transformers' `QuantizedCache` does, and so is the window of `window` tokens before them.

The layer contract (`transformers`' `CacheLayerMixin`, with the tokens' true positions in `cache_kwargs`):

- `update(key_states, value_states, {"positions": ...})` adds the new tokens to the window (the first
  ones fill the sinks) and returns the keys and values attention reads, `[batch, kv_heads, n, head_dim]`:
  exact regions as they are, the middle rebuilt from what is stored (and, pre-RoPE, every key rotated by its
  true position), in the dtype of the new keys (the model's), assembled by `patchkv.operands.dense`;
- `update_latent(...)`, the latent variant, returns the same tokens as a `patchkv.visible.Visible`: exact
  regions and the middle *as stored*, for attention that reads codes directly (decode steps, top-k);
- `after_attention()` encodes whatever has left the window into the near region and the middle (with the layer's
  codecs).

Between forwards a layer holds exactly the sinks, the middle's latents and the last `window` tokens; later
forwards read the middle from its latents. The cache also records the true position of every token
(`positions`, `[batch, seen]`, once for all layers), by which pre-RoPE mode rotates rebuilt keys: static
position schemes, gaps in `position_ids` and left padding are all exact. Each layer is built with its
`LayerPatch` (codecs, mode, rotary table), as `QuantizedLayer` gets its settings. A layer stores and hands out
what it holds: the mode is read where operands are assembled (`patchkv.operands`: `update`'s dense keys and values,
the read-only `keys`/`values` views) and by the attention path (a salience method's `Observation.read_keys`), never
here.

On layer bases across layers (codecs whose `span` is S > 1, artifact format version 7) one code per token serves S
layers (consecutive layers of one attention kind), made from their keys (or values) concatenated. The span's last layer (its `owner`) holds the
span's middle; each other layer of the span (a member) holds none of its own and reads the owner's (`middle`)
through its own rows of the span's basis. A member's tokens leaving its window are `parked` with the owner, which
codes them with its own in one go (`_code`); layers run in order, so the span's middle is whole at every forward's
start, and nothing reads a member between its forward and the owner's. Bytes are counted once, at the owner; whole-
cache operations touch each layer's own tensors, and `crop` leaves the span's middle to the owner (cropped last). A
span's layers are of one attention kind; in a sliding span the owner also drops the oldest tokens for all (`_slide`).

A `LatentCache` belongs to one patch: it records the patch's fingerprint (artifact checksum + methods)
and a patched model refuses a cache written under another patch, or any other cache (`check_cache`, the one check
the decoder's guard and the attention path both call). An unpatched model writing into it
gets a `PatchKVError` (from `update`), never a silent mix of full and latent states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .compat import init_cache_layer
from .errors import PatchKVError
from .key_space import rebuild
from .methods import Evict, Observation, Salience
from .nbytes import storage_nbytes
from .operands import dense, unpatched
from .patch import LayerPatch
from .visible import Visible

#: the middle's buffer grows by this many tokens at a time
PAGE = 64
#: the near region's oldest tokens move into the middle in blocks of at least a this-many-th of the region
NEAR_BLOCKS = 64
SALIENT = ("salient_keys", "salient_values", "salient_index", "salient_score", "salient_scale")
NEAR = ("near_keys", "near_values")
#: an int8 / int4 window's scales (width 0 while the window is exact)
WINDOW_SCALE = "recent_scale"
#: the bitmap of the tokens held of those that left the window (`Evict`; zero bytes without it)
KEPT = "evict_kept"
#: every region a layer holds: sinks, middle and window, then a salience method's exact tokens, the near tokens, the
#: window's scales and the kept-token bitmap
REGIONS = ("sink_keys", "sink_values", "latent_keys", "latent_values", "recent_keys", "recent_values", *SALIENT, *NEAR,
           WINDOW_SCALE, KEPT)


class PositionTrack:
    """True positions of every token a cache has seen, `[batch, seen]` int32, shared by its layers."""

    def __init__(self):
        self.positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def extend(self, start: int, new: torch.Tensor) -> torch.Tensor:
        """A layer that has seen `start` tokens adds `new` `[batch, n]`; returns positions `[batch, start + n]`.
        The first layer of a forward appends; the others find the positions already there."""
        end = start + new.shape[1]
        if self.length == start:
            new = new.to(torch.int32) if self.positions is None else new.to(self.positions.device, torch.int32)
            self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=1)
        elif self.length < end:
            raise PatchKVError(f"LatentCache layers disagree on the tokens seen (a layer at {start} tokens, the cache "
                               f"at {self.length}); use one LatentCache per sequence batch and run every layer.")
        return self.positions[:, :end]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.positions is not None:
            self.positions = fn(self.positions)

    def crop(self, length: int) -> None:
        if self.positions is not None:
            self.positions = self.positions[:, :length]


class LatentLayer(CacheLayerMixin):
    """One layer of a `LatentCache`, an `AttentionLayer` (`update_latent`, `after_attention`, `get_seq_length`) and a
    `transformers` cache layer. Filled by the patched attention through `append`; see the module doc."""

    is_compileable = False
    is_croppable = True

    def __init__(self, patch: LayerPatch, sink_tokens: int = 0, window: int = 0, sliding_window: int | None = None,
                 track: PositionTrack | None = None, salience: Salience | None = None, near_tokens: int = 0,
                 window_bits: int = 16, evict: Evict | None = None):
        init_cache_layer(self)  # CacheLayerMixin.__init__ would assign .keys/.values, read-only views here
        self.patch = patch  # codecs, mode and rotary table of the attention layer it serves
        # a sliding layer keeps its sinks exact while they are in its window, and at most `sliding_window - 1` recent
        self.sink_tokens = sink_tokens
        self.window = window if sliding_window is None else min(window, sliding_window - 1)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.salience = None if self.is_sliding else salience  # a sliding layer keeps only its last tokens
        self.evict = None if self.is_sliding else evict  # ... and drops none of them
        self.near_tokens = near_tokens
        self.near_block = max(1, near_tokens // NEAR_BLOCKS)  # the fewest near tokens moving into the middle at once
        self.window_bits = window_bits  # 8 / 4: the window held as int8 / int4 between forwards
        self.track = track if track is not None else PositionTrack()
        self.tensors: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # the middle's storage, `tensors` its first tokens
        self.cumulative_length = 0
        self.pending = 0  # `Evict`: the last tokens to leave the window, coded as they left and not yet ranked
        self.record_past = False
        self.device: torch.device | None = None
        # a basis across layers (its codecs' `span` > 1): each member's middle is its span's, held by the span's last
        # layer (`owner`), which codes the tokens its members `parked` this forward with its own (see the module doc)
        self.owner: LatentLayer | None = None
        self.members: list[LatentLayer] = []  # the owner's: the span's other layers
        self.parked: list[list[torch.Tensor]] = []

    # ----- the layer contract -------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict | None = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys and values `[batch, kv_heads, n, head_dim]` (in cache space) at the true positions
        `cache_kwargs["positions"]` `[batch, n]`; returns the keys and values attention reads, `[batch, kv_heads,
        visible, head_dim]` in key_states' dtype (see the module doc)."""
        positions = (cache_kwargs or {}).get("positions")
        if positions is None:
            raise PatchKVError(_UNPATCHED_WRITE)
        return dense(self.patch, self.update_latent(key_states, value_states, positions), key_states.dtype)

    def update_latent(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> Visible:
        """`update`'s latent variant: the visible tokens with the middle as stored (see the module doc)."""
        self.append(key_states, value_states, positions)
        return self.visible(key_states.shape[2])

    # ----- writing ----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add keys and values `[batch, kv_heads, n, head_dim]` at true `positions` `[batch, n]`, exact (the
        first tokens seen fill the sinks, the others join the window until `after_attention`)."""
        if self.is_initialized and self.tensors["sink_keys"].dtype != keys.dtype:
            raise PatchKVError(f"this cache holds {self.tensors['sink_keys'].dtype} tensors and the model now "
                               f"computes in {keys.dtype} (its dtype changed after the cache was written); start a "
                               "new cache (generate() makes one), or change the dtype before writing it.")
        if not self.is_initialized:  # empty regions of their own, not views that would keep this forward's K/V alive
            empty = {"keys": _empty(keys), "values": _empty(values)}
            self.tensors = {name: empty[name.split("_")[1]] for name in ("sink_keys", "sink_values", "recent_keys",
                                                                          "recent_values")}
            self.tensors.update(no_salient(keys, values, self.salience))
            self.tensors.update(no_window_scale(empty["keys"]))
            self.tensors.update(no_kept(keys))
            for name, codec in zip(("latent_keys", "latent_values", *NEAR), (self.patch.keys, self.patch.values,
                                                                             self.patch.near_keys, self.patch.near_values)):
                self.tensors[name] = codec.empty(keys)
            self.device, self.is_initialized = keys.device, True
        t = self.tensors
        if t[WINDOW_SCALE].shape[-1]:  # an int8 / int4 window: this forward reads it, and its own tokens, as the model
            t["recent_keys"], t["recent_values"] = _read_copies(t, "recent", keys.dtype)
            t.update(no_window_scale(t["recent_keys"]))
        room = max(0, self.sink_tokens - self.cumulative_length)  # the sequence's first tokens (a sliding layer drops
        # its sinks once they leave its window, and they are not refilled)
        for kind, x in (("keys", keys), ("values", values)):
            t[f"sink_{kind}"] = torch.cat([t[f"sink_{kind}"], x[:, :, :room]], dim=2)
            t[f"recent_{kind}"] = torch.cat([t[f"recent_{kind}"], x[:, :, room:]], dim=2)
        self.track.extend(self.cumulative_length, positions)
        self.cumulative_length += keys.shape[2]

    def after_attention(self, observed: Observation | None = None) -> None:
        """The forward's attention is done: the tokens beyond the last `window` are encoded into the middle (scored
        for the salience method, with the forward's queries in `observed` for one that observes), and a sliding layer
        keeps only the last `sliding_window - 1` tokens (all of them while recording); an int8 or int4 window is then
        held so."""
        t = self.tensors
        leaving = t["recent_keys"].shape[2] - self.window
        if leaving > 0:
            with torch.profiler.record_function("patchkv::encode"):
                self._encode(leaving, observed)
        if self.is_sliding and not self.record_past:
            self._slide()
        if self.window_bits != 16:
            t["recent_keys"], t["recent_values"], t[WINDOW_SCALE] = _copies(t["recent_keys"], t["recent_values"],
                                                                            self.window_bits)
        elif t[WINDOW_SCALE].shape[2] != t["recent_keys"].shape[2]:  # an exact window: no scales, one per token
            t.update(no_window_scale(t["recent_keys"]))

    def _encode(self, leaving: int, observed: Observation | None = None) -> None:
        """The oldest `leaving` tokens of the window leave it: an `Evict` method drops its lowest ranked of them, a
        salience method keeps its best exact, and the rest are coded into the near region or the middle."""
        t = self.tensors
        start, passed = self.coded_len, self.passed  # the leaving tokens' first coded index (middle, then near tokens,
        # in position order); the tokens that left the window before them
        exact = [t[f"recent_{kind}"][:, :, :leaving] for kind in ("keys", "values")]
        if self.owner is not None:  # a span member: the span's last layer codes these with its own
            self.owner.parked.append(exact)
            for kind in ("keys", "values"):
                t[f"recent_{kind}"] = t[f"recent_{kind}"][:, :, leaving:].clone()
            return
        scorers = [m for m in (self.evict, self.salience) if m is not None]
        if observed is not None and any(m.observes for m in scorers):  # the leaving tokens as this forward's queries
            observed.positions = self._positions(self.kept)[:, -self.window_len:][:, :leaving]  # read them
            observed.keys = observed.read_keys(exact[0], observed.positions)
        # the middle's codes of the leaving tokens (with near codes, made only for a scorer that reads them)
        stored = [self._code(i, x) for i, x in enumerate(exact)] \
            if not self.near_tokens or any(m.reads_codes for m in scorers) else None
        self.parked = []
        if self.evict is not None:
            with torch.profiler.record_function("patchkv::evict"):
                exact, stored = self._evict(exact, stored, passed, observed)
        for kind in ("keys", "values"):
            t[f"recent_{kind}"] = t[f"recent_{kind}"][:, :, leaving:].clone()  # not a view of the forward's K/V
        if self.salience is not None:
            with torch.profiler.record_function("patchkv::salience"):
                self._keep_salient(*exact, stored, start, observed)
        if self.near_tokens:
            self._encode_near(exact, stored)
        else:
            for kind, encoded in zip(("keys", "values"), stored):
                self._grow(f"latent_{kind}", encoded)
        if self.evict is not None and self.pending >= self.evict.block:
            with torch.profiler.record_function("patchkv::evict"):
                self._evict_pending(observed)

    def _code(self, kind: int, x: torch.Tensor) -> torch.Tensor:
        """Leaving tokens' keys (`kind` 0) or values (1) `[batch, kv_heads, n, head_dim]` as the middle stores them,
        `[batch, 1, n, width]`: by the layer's codec, or, at a span's last layer, with the tokens its members parked
        (one code per token for the whole span, its layers' heads concatenated in layer order)."""
        codec = (self.patch.keys, self.patch.values)[kind]
        if codec.span == 1:
            return codec.encode(x)
        parts = [*(exact[kind] for exact in self.parked), x]
        if len(parts) != codec.span or any(p.shape[2] != x.shape[2] for p in parts):
            raise PatchKVError(f"the {codec.span} layers of a basis across layers disagree on the tokens leaving their "
                               f"windows ({[p.shape[2] for p in parts]}): every layer of the model must run each "
                               "forward, in order, on one LatentCache.")
        if any(p.device != x.device for p in parts):
            devices = sorted({str(p.device) for p in parts})
            raise PatchKVError(f"the {codec.span} layers sharing a basis run on {devices}: a basis across layers "
                               "codes them together, so they must share a device (place them on one, or calibrate "
                               "with layers_per_basis=1).")
        return codec.encode_span(torch.cat(parts, dim=1))

    def _evict(self, exact: list[torch.Tensor], stored: list[torch.Tensor] | None, passed: int,
               observed: Observation | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Tokens leaving the window after `passed` others have, exact keys and values `[batch, kv_heads, n,
        head_dim]` and their middle codes `[batch, 1, n, width]` (or None): at least `block` of them, the `Evict`
        method's lowest ranked go (the same number from each sequence of the batch, and from `observed`); fewer all
        stay, pending (`_evict_pending` ranks them once `block` have gathered). The bitmap records which stay;
        returns those that stay, in position order."""
        batch, _, n, _ = exact[0].shape
        drop = self.evict.dropped(n)
        held = torch.ones(batch, n, dtype=torch.bool, device=exact[0].device)
        # a group of `block` is ranked on its own; tokens pending before it stay (they are no longer the newest coded)
        self.pending = 0 if n >= self.evict.block else self.pending + n
        if drop:
            held, index = _lowest_gone(self.evict.rank(self.patch, *exact, stored and tuple(stored), observed), drop)
            exact = [_take(x, index) for x in exact]
            stored = None if stored is None else [_take(x, index) for x in stored]
            if observed is not None and observed.keys is not None:
                observed.keys, observed.positions = _take(observed.keys, index), observed.positions.gather(1, index)
        self.tensors[KEPT] = _append_bits(self.tensors[KEPT], passed, held)
        return exact, stored

    def _evict_pending(self, observed: Observation | None) -> None:
        """`block` or more tokens have left the window in smaller groups (decode steps, short chunks), each coded as
        it left: the `Evict` method ranks them together from their codes (keys and values rebuilt in cache space; with
        near codes, those of them still in the near region) and its lowest go, as they would have from a group that
        left at once; their rows, bits and salient copies go with them. A score that reads how a token is coded
        (`CodeError`) needs it exact: those tokens all stay."""
        t, lp = self.tensors, self.patch
        region, codecs = ("near", (lp.near_keys, lp.near_values)) if self.near_tokens else \
            ("latent", (lp.keys, lp.values))
        n = min(self.pending, t[f"{region}_keys"].shape[2])
        self.pending = 0
        drop = self.evict.dropped(n)
        if not drop or self.evict.reads_codes:
            return
        dtype = t["sink_keys"].dtype
        exact = [rebuild(codec, t[f"{region}_{kind}"][:, 0, -n:], dtype)
                 for codec, kind in zip(codecs, ("keys", "values"))]
        passed, start = self.passed, self.coded_len - n
        if observed is not None and self.evict.observes:  # the pending tokens, as this forward's queries read them
            positions = self.track.positions[:, self.sink_len + passed - n:self.sink_len + passed]
            observed.keys, observed.positions = observed.read_keys(exact[0], positions), positions
        held, index = _lowest_gone(self.evict.rank(lp, *exact, None, observed), drop)
        for kind in ("keys", "values"):
            name = f"{region}_{kind}"
            kept = _take(t[name][:, :, -n:], index)
            if region == "latent":  # written back into the middle's buffer, which stays its prefix
                t[name] = t[name][:, :, :-n]
                self._grow(name, kept)
            else:
                t[name] = torch.cat([t[name][:, :, :-n], kept], dim=2)
        bits = unpack_bits(t[KEPT], passed)
        bits[:, passed - n:] = held
        t[KEPT] = _pack_bits(bits)
        if self.salience is not None and t["salient_keys"].shape[2]:
            self._drop_salient_evicted(start, held)

    def _drop_salient_evicted(self, start: int, held: torch.Tensor) -> None:
        """After `_evict_pending` dropped the coded tokens at indices `start + i` where `held` `[batch, n]` is False:
        their salient copies go (every KV head keeps as many as the one left with the fewest, its best by score, and
        no more than the capacity of the tokens now coded), and the copies of later tokens move down to their new
        coded index."""
        t = self.tensors
        index = t["salient_index"].squeeze(-1).long()  # [batch, kv_heads, s]
        shift = torch.cat([torch.zeros_like(held[:, :1], dtype=torch.long), (~held).long().cumsum(1)], dim=1)
        later = index >= start
        offset = (index - start).clamp(0, held.shape[1] - 1)
        gone = later & ~held.unsqueeze(1).expand(-1, index.shape[1], -1).gather(2, offset)
        moved = index - torch.where(later, shift.unsqueeze(1).expand(-1, index.shape[1], -1).gather(2, offset), 0)
        t["salient_index"] = moved.to(torch.int32).unsqueeze(-1)
        self._keep_valid_copies(~gone, self.salience.capacity(self.coded_len))

    def _encode_near(self, exact: list[torch.Tensor], stored: list[torch.Tensor] | None = None) -> None:
        """The tokens leaving the window, exact keys and values `[batch, kv_heads, n, head_dim]` (and their middle
        codes `stored`, if already made): the last `near_tokens` of the near region and these stay there (the
        newcomers coded at the near rate); the older ones move into the middle, near codes decoded and coded again at
        the middle's rate, newcomers that do not stay coded at that rate straight from their exact values."""
        t, lp = self.tensors, self.patch
        held, leaving = self.near_len, exact[0].shape[2]
        moving = max(0, held + leaving - self.near_tokens)  # the oldest of the near region and the newcomers
        if moving:  # a decode step's one newcomer moves a block: recoding runs every `near_block` steps, not each
            moving = min(max(moving, self.near_block), held + leaving)
        recoded, direct = min(moving, held), moving - min(moving, held)
        for i, (kind, x) in enumerate(zip(("keys", "values"), exact)):
            middle, near = getattr(lp, kind), getattr(lp, f"near_{kind}")
            name = f"near_{kind}"
            parts = []
            if recoded:
                parts.append(middle.encode(near.basis.reconstruct(near.decode(t[name][:, :, :recoded])).to(x.dtype)))
            if direct:
                parts.append(middle.encode(x[:, :, :direct]) if stored is None else stored[i][:, :, :direct])
            if parts:
                self._grow(f"latent_{kind}", parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
            t[name] = torch.cat([t[name][:, :, recoded:], near.encode(x[:, :, direct:])], dim=2)

    def _keep_salient(self, keys: torch.Tensor, values: torch.Tensor, stored: list[torch.Tensor] | None, start: int,
                      observed: Observation | None = None) -> None:
        """Tokens leaving the window at coded index `start` (the middle's, then the near tokens', in position order:
        a token moving from the near region into the middle keeps its index), exact `[batch, kv_heads, n, head_dim]`
        and as the middle stores them (None with near codes, for a method that does not read them): each KV head keeps the `capacity` best scored of the exact tokens it held and
        these (kept in coded order)."""
        t = self.tensors
        n = keys.shape[2]
        capacity = self.salience.capacity(start + n)
        if capacity == 0:
            return
        score = self.salience.rank(self.patch, keys, values, stored and tuple(stored), observed).unsqueeze(-1)
        if _unmoved(t["salient_score"], score, capacity):
            return
        index = torch.arange(start, start + n, dtype=torch.int32, device=keys.device)
        index = index.view(1, 1, n, 1).expand(*keys.shape[:2], n, 1)
        copies = _copies(keys, values, self.salience.bits)
        held = {name: torch.cat([t[name], new], dim=2) for name, new in zip(
            SALIENT, (*copies[:2], index, score.to(torch.float32), copies[2]))}
        if held["salient_score"].shape[2] > capacity:
            held = _best(held, held["salient_score"].squeeze(-1), capacity)
        t.update(held)

    def _grow(self, name: str, new: torch.Tensor) -> None:
        """Append `new` `[batch, 1, n, width]` to the middle `name`, held as the first tokens of a buffer that
        grows by pages of `PAGE` tokens (a decode step writes one token, it does not copy the whole middle)."""
        held, buffer = self.tensors[name], self.buffers.get(name)
        n, total = held.shape[2], held.shape[2] + new.shape[2]
        prefix = buffer is not None and held.data_ptr() == buffer.data_ptr() and held.stride() == buffer.stride() \
            and held.shape[:2] == buffer.shape[:2]
        if not prefix or total > buffer.shape[2]:
            buffer = self._paged(name, held, total)
        buffer[:, :, n:total] = new
        self.tensors[name] = buffer[:, :, :total]

    def _paged(self, name: str, held: torch.Tensor, room: int) -> torch.Tensor:
        """Hold the middle `name`, `held` `[batch, 1, n, width]`, as the first tokens of a new buffer of whole pages
        with room for `room` tokens (the old buffer, if any, is let go); returns the buffer."""
        n = held.shape[2]
        buffer = held.new_empty(*held.shape[:2], -(-room // PAGE) * PAGE, held.shape[3])
        buffer[:, :, :n] = held
        self.buffers[name], self.tensors[name] = buffer, buffer[:, :, :n]
        return buffer

    def _drop_salient_past(self, coded: int) -> None:
        """After a crop: exact tokens whose coded index is no longer held go. Every KV head keeps as many as the one
        that kept the fewest (its best by score); the others are read from their codes again."""
        self._keep_valid_copies(self.tensors["salient_index"].squeeze(-1) < coded)

    def _keep_valid_copies(self, valid: torch.Tensor, most: int | None = None) -> None:
        """Salient copies where `valid` `[batch, kv_heads, s]` is False go: every KV head keeps as many as the one with
        the fewest valid (its best by score), and at most `most`."""
        t = self.tensors
        keep = int(valid.sum(-1).min()) if most is None else min(int(valid.sum(-1).min()), most)
        if keep < valid.shape[-1]:
            score = t["salient_score"].squeeze(-1).masked_fill(~valid, float("-inf"))
            t.update(_best({name: t[name] for name in SALIENT}, score, keep))

    def _slide(self) -> None:
        """A sliding layer keeps its last `sliding_window - 1` tokens. A span's other layers leave that to its last
        layer, which holds their middle (and runs after them): it trims its own regions, then their sinks to its own
        (every layer of the span has seen the same tokens and keeps the same window)."""
        if self.owner is not None:
            return
        self._keep_last(self.sliding_window - 1)
        for member in self.members:
            drop = member.sink_len - self.sink_len
            for kind in ("keys", "values") if drop > 0 else ():
                member.tensors[f"sink_{kind}"] = member.tensors[f"sink_{kind}"][:, :, drop:].clone()

    def _keep_last(self, n: int) -> None:
        """A sliding layer keeps its last n tokens: the oldest leave first, sinks then middle (copied out, the middle
        into a new paged buffer, so the dropped ones and the old buffer are freed; the window is never longer than
        n)."""
        for region, drop in zip(("sink", "latent", "near"), self._oldest(self.kept - n)):
            if drop:
                for kind in ("keys", "values"):
                    name = f"{region}_{kind}"
                    kept = self.tensors[name][:, :, drop:]
                    if region == "latent":
                        self._paged(name, kept, kept.shape[2])
                    else:
                        self.tensors[name] = kept.clone()

    def _oldest(self, excess: int) -> tuple[int, int, int]:
        """(sinks, middle tokens, near tokens) to drop so that `excess` of the oldest tokens go."""
        excess = max(0, excess)
        sinks = min(excess, self.tensors["sink_keys"].shape[2])
        middle = min(excess - sinks, self.middle_len)
        return sinks, middle, excess - sinks - middle

    # ----- reading ----------------------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Tokens held (all of them, or the last ones of a sliding layer)."""
        return sum(self._tokens(n) for n in ("sink_keys", "latent_keys", "near_keys", "recent_keys"))

    def visible(self, query_len: int) -> Visible:
        """What attention sees after `append`: sinks, middle (as stored, `[batch, m, width]`) and window
        (the window before this forward and its own tokens) with their true positions; for a sliding layer, the
        last `window - 1 + query_len` tokens."""
        kept = self.kept
        if self.is_sliding:  # the oldest beyond the window go (the window holds this forward's tokens)
            kept = min(kept, self.sliding_window - 1 + query_len)
        return self._held(kept)

    def _held(self, kept: int) -> Visible:
        """The last `kept` of the tokens held (sinks and middle as held, the oldest dropped first), with their true
        positions."""
        t = {**self.tensors, **self.middle()}
        if kept < self.kept:
            for region, drop in zip(("sink", "latent", "near"), self._oldest(self.kept - kept)):
                for kind in ("keys", "values"):
                    t[f"{region}_{kind}"] = t[f"{region}_{kind}"][:, :, drop:]
        ns, nn, nr = t["sink_keys"].shape[2], t["near_keys"].shape[2], t["recent_keys"].shape[2]
        columns = self.columns() if kept == self.kept else None  # a sliding layer (which drops none) may cut some
        positions = self._positions(kept) if columns is None else \
            self.track.positions[:, :self.cumulative_length].gather(1, columns)
        sink_pos, middle_pos, near_pos, window_pos = positions.split([ns, kept - ns - nn - nr, nn, nr], dim=1)
        dtype = t["sink_keys"].dtype
        window_keys, window_values = _read_copies(t, "recent", dtype)
        seen = Visible(t["sink_keys"], t["sink_values"], window_keys, window_values,
                       t["latent_keys"].squeeze(1), t["latent_values"].squeeze(1), sink_pos, middle_pos, window_pos,
                       columns=columns)
        if nn:
            seen.near_keys, seen.near_values = t["near_keys"].squeeze(1), t["near_values"].squeeze(1)
            seen.near_positions = near_pos
        if t["salient_keys"].shape[2]:
            index = t["salient_index"].squeeze(-1).long()
            seen.salient_keys, seen.salient_values = _read_copies(t, "salient", dtype)
            seen.salient_index = index
            coded_pos = torch.cat([middle_pos, near_pos], dim=1) if nn else middle_pos
            seen.salient_positions = coded_pos.unsqueeze(1).expand(-1, index.shape[1], -1).gather(2, index)
        return seen

    def columns(self) -> torch.Tensor | None:
        """Where `Evict` has dropped tokens: the index in the sequence (the mask's column) of every token held,
        sinks, coded tokens (the bitmap's set bits) and window, int64 `[batch, kept]`; None where every token seen is
        held, in order."""
        passed = self.passed
        if self.evict is None or self.coded_len == passed:
            return None
        batch, ns = self.batch_size, self.sink_len
        coded = unpack_bits(self.tensors[KEPT], passed).nonzero()[:, 1].view(batch, -1) + ns
        device, end = coded.device, self.cumulative_length
        return torch.cat([torch.arange(ns, device=device).expand(batch, ns), coded,
                          torch.arange(end - self.window_len, end, device=device).expand(batch, -1)], dim=1)

    @property
    def passed(self) -> int:
        """Tokens of a full-attention layer that have left its window (coded, or dropped by `Evict`)."""
        return self.cumulative_length - self.sink_len - self.window_len

    def _positions(self, kept: int) -> torch.Tensor:
        """True positions `[batch, kept]` of the last `kept` tokens seen."""
        return self.track.positions[:, self.cumulative_length - kept: self.cumulative_length]

    def middle(self) -> dict[str, torch.Tensor]:
        """The middle, `latent_keys` and `latent_values` `[batch, 1, m, width]`: a span member's is its span's, held
        by the span's last layer (none before that layer's first forward)."""
        held = self.owner if self.owner is not None and self.owner.is_initialized else self
        return {name: held.tensors[name] for name in ("latent_keys", "latent_values")}

    def _tokens(self, name: str) -> int:
        """Tokens the region `name` holds (0 before the first forward)."""
        if not self.tensors:
            return 0
        return (self.middle() if name.startswith("latent_") else self.tensors)[name].shape[2]

    sink_len = property(lambda self: self._tokens("sink_keys"))
    middle_len = property(lambda self: self._tokens("latent_keys"))
    near_len = property(lambda self: self._tokens("near_keys"))
    salient_len = property(lambda self: self._tokens("salient_keys"))  # copies per KV head
    window_len = property(lambda self: self._tokens("recent_keys"))

    @property
    def coded_len(self) -> int:
        """Tokens held as codes: the middle's and the near tokens' (what a salience method's indices point into)."""
        return self.middle_len + self.near_len

    @property
    def batch_size(self) -> int:
        return self.tensors["sink_keys"].shape[0] if self.tensors else -1

    def _full(self, kind: str) -> torch.Tensor | None:
        """Every kept token's key (rotated, as the unpatched model would cache it) or value, `[batch, kv_heads,
        kept, head_dim]`, the middle reconstructed from its latents."""
        return unpatched(self.patch, self._held(self.kept), kind) if self.is_initialized else None

    @property
    def keys(self) -> torch.Tensor | None:
        """Read-only view: the keys `[batch, kv_heads, kept, head_dim]` as the unpatched model would hold them."""
        return self._full("keys")

    @property
    def values(self) -> torch.Tensor | None:
        """Read-only view: the values `[batch, kv_heads, kept, head_dim]`, the middle reconstructed."""
        return self._full("values")

    def nbytes(self) -> int:
        """Bytes of what the layer holds: every region's tokens (what the compression ratio is measured on)."""
        return sum(t.nbytes for t in self.tensors.values())

    def allocated_nbytes(self) -> int:
        """Bytes of storage the layer keeps: every storage under its regions and buffers, once and whole (`nbytes`
        plus the middle's unused buffer: under `PAGE` tokens past its end, or tokens cropped away that it still
        holds)."""
        return storage_nbytes([*self.tensors.values(), *self.buffers.values()])

    # ----- the CacheLayerMixin interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise PatchKVError(_UNPATCHED_WRITE)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        full = self.cumulative_length >= self.sliding_window
        offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        return (self.sliding_window - 1 if full else self.cumulative_length) + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.tensors, self.buffers, self.cumulative_length, self.is_initialized = {}, {}, 0, False
        self.pending, self.parked = 0, []

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Assisted generation's hook (transformers >= 5.25 passes `recurrent_states_to_keep`, meaningless for an
        attention cache, which keeps every token until `crop`)."""
        self.record_past = True

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tensors, self.buffers = {name: fn(t) for name, t in self.tensors.items()}, {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as `transformers` passes it): from the
        window first, then the middle, then the sinks. Tokens already encoded stay encoded; the window refills
        as generation proceeds."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        removed = min(-tokens_to_remove, self.cumulative_length)  # the last tokens of the sequence
        if removed == 0 or not self.is_initialized:
            return
        remove = removed if self.evict is None else self._crop_kept(removed)  # those of them the layer holds
        if self.is_sliding and self.cumulative_length >= self.sliding_window and not self.record_past:
            raise PatchKVError("This sliding-window latent layer no longer holds the tokens to crop; call "
                               "cache.activate_past_recording() before generating if you need to roll back.")
        for region in ("recent", "near", "latent", "sink"):
            n = min(remove, self._tokens(f"{region}_keys"))
            if n and region == "latent" and self.owner is not None:  # the span's middle, cropped by its last layer
                remove -= n  # (later in the loop over layers: it still holds these tokens)
            elif n:  # the middle stays a view of its buffer (the next tokens are written after it); other regions are
                for name in (f"{region}_keys", f"{region}_values", *((WINDOW_SCALE,) if region == "recent" else ())):
                    kept = self.tensors[name][:, :, :-n]  # copied out, so the tokens cropped from them are freed
                    self.tensors[name] = kept if region == "latent" else kept.clone()
                remove -= n
        self._drop_salient_past(self.coded_len)
        self.cumulative_length -= removed
        if self.is_sliding:
            self._slide()

    def _crop_kept(self, remove: int) -> int:
        """Before a crop of the last `remove` tokens of the sequence: the bitmap cut to the tokens that left the window
        before them; returns how many tokens the layer holds among them (window, coded, sinks)."""
        window, passed = min(remove, self.window_len), self.passed
        cut = min(remove - window, passed)
        if not cut:
            return remove
        bits = unpack_bits(self.tensors[KEPT], passed)
        held = bits[:, passed - cut:].sum(1)
        if bool((held != held[0]).any()):
            raise PatchKVError(f"cannot crop {remove} tokens: the sequences of this batch hold different numbers of "
                               f"them ({held.tolist()}; Evict dropped different tokens from each); crop at most "
                               f"{window} tokens (the window) or one sequence at a time.")
        self.tensors[KEPT] = _pack_bits(bits[:, :passed - cut])
        self.pending = max(0, self.pending - cut)  # the pending tokens are the last to have left, all held
        return window + int(held[0]) + (remove - window - cut)

    def offload(self) -> None:
        self.map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.device is not None:
            self.map(lambda t: t.to(self.device, non_blocking=True))


_UNPATCHED_WRITE = ("A patchkv LatentCache holds latents and cannot take full keys and values: it was passed to a model "
                    "that is not patched (or was patched by another library). Use it only with the patched model "
                    "that made it, or pass a fresh DynamicCache to the unpatched model.")


class LatentCache(Cache):
    """The cache of a model patched by `patchkv.apply`; `generate()` builds one by itself.

        cache = patchkv.LatentCache(model)            # model is patched
        out = model(input_ids, cache=cache, use_cache=True)
        more = model(next_ids, cache=out.cache, use_cache=True)

    offloading: keep each layer's tensors on CPU between its forwards (moved back to the layer's device
    just before it computes).
    """

    def __init__(self, model: nn.Module, *, offloading: bool = False):
        patch = getattr(model, "patchkv", None)
        if patch is None:
            raise PatchKVError("patchkv.LatentCache(model) needs a patched model: call patchkv.apply(model, artifact) "
                               "first (an unpatched model uses transformers' DynamicCache).")
        self.track = PositionTrack()
        plan = patch.plan
        layers = [LatentLayer(lp, plan.sink_tokens, plan.window, lp.sliding_window, self.track, plan.salience,
                              plan.near_tokens, plan.window_bits, plan.evict) for lp in patch.layers]
        for i, layer in enumerate(layers):  # a basis across layers: its members read the codes its last layer holds
            codec = layer.patch.keys
            if codec.position < codec.span - 1:
                layer.owner = layers[codec.span_layers[-1]]
                layer.owner.members.append(layer)
        if offloading and any(layer.owner is not None for layer in layers):
            raise PatchKVError("offloading moves each layer's tensors between its forwards, and layers sharing a basis "
                               "across layers read their span's codes from its last layer: use offloading=False, or "
                               "an artifact calibrated with layers_per_basis=1.")
        super().__init__(layers=layers)
        self.offload_layers = offloading
        self.fingerprint = patch.fingerprint
        self.plan_description = plan.describe() or "lowrank"

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict | None = None, *args, **kwargs):
        """The `Cache` contract: layer `layer_idx`'s `LatentLayer.update`, which needs the tokens' true positions in
        `cache_kwargs["positions"]` (the patched attention passes them); any other writer (an unpatched model)
        gets a `PatchKVError`."""
        if (cache_kwargs or {}).get("positions") is None:
            raise PatchKVError(_UNPATCHED_WRITE)
        return self.layer(layer_idx).update(key_states, value_states, cache_kwargs)

    def layer(self, layer_idx: int) -> LatentLayer:
        """The layer the patched attention writes to, brought back to its device if offloaded."""
        if layer_idx >= len(self.layers):
            raise PatchKVError(f"This LatentCache has {len(self.layers)} layers, the model asked for layer {layer_idx}: "
                               "it was made for another model.")
        layer = self.layers[layer_idx]
        if self.offload_layers:
            layer.prefetch()
        return layer

    def done(self, layer_idx: int) -> None:
        """Called by the patched attention after a layer computed: offloads it when asked to."""
        if self.offload_layers:
            self.layers[layer_idx].offload()

    # ----- whole-cache operations keep the position track in step with the layers --------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.track.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.track.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.track.map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.track.crop(max(layer.cumulative_length for layer in self.layers))

    def reset(self) -> None:
        super().reset()
        self.track.positions = None

    # ----- accounting --------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: every region of every layer, plus the position track."""
        positions = self.track.positions.nbytes if self.track.positions is not None else 0
        return sum(layer.nbytes() for layer in self.layers) + positions

    def allocated_nbytes(self) -> int:
        """Bytes of storage kept: every buffer of every layer, whole (`nbytes` plus what the middles' buffers hold
        beyond their tokens), plus the position track's. The patch's RoPE tables are not the cache's (one for all
        caches of the model): `patchkv.nbytes.rope_nbytes(model)`."""
        positions = self.track.positions.untyped_storage().nbytes() if self.track.positions is not None else 0
        return sum(layer.allocated_nbytes() for layer in self.layers) + positions

    def describe(self) -> str:
        """One line per layer: its regions' token counts and bytes."""
        tables = {id(layer.patch.rope): layer.patch.rope for layer in self.layers}
        lines = [f"LatentCache({self.plan_description}), {self.get_seq_length()} tokens, {self.nbytes()} bytes "
                 f"({self.allocated_nbytes()} allocated; the patch's RoPE tables, shared by its caches, "
                 f"{sum(t.nbytes() for t in tables.values())})"]
        for i, layer in enumerate(self.layers):
            kind = f"sliding {layer.sliding_window} (latents only)" if layer.is_sliding else "full"
            copies = "exact" if layer.salience is None or layer.salience.bits == 16 else \
                f"as int{layer.salience.bits} copies"
            salient = f" ({layer.salient_len} per KV head also {copies})" if layer.salient_len else ""
            if layer.evict is not None and layer.is_initialized:
                salient += f", {layer.passed - layer.coded_len} dropped"
            held = f" (int{layer.window_bits})" if layer.window_bits != 16 else ""
            lines.append(f"  layer {i}: {kind}, sinks {layer.sink_len}, middle {layer.middle_len}{salient}, "
                         f"window {layer.window_len}{held}, {layer.nbytes()} bytes")
        return "\n".join(lines)


def check_cache(cache: Any, fingerprint: str) -> LatentCache:
    """`cache` as the patch with `fingerprint` continues it: its own `LatentCache`. Any other cache (a `DynamicCache`,
    one written unpatched, a `LatentCache` written under another patch) raises a `PatchKVError`."""
    if not isinstance(cache, LatentCache):
        written = cache.get_seq_length() if hasattr(cache, "get_seq_length") else "?"
        raise PatchKVError(
            f"The patched model was given a {type(cache).__name__} (holding {written} tokens); patchkv stores "
            "latents in its own cache. Pass cache=patchkv.LatentCache(model), or none (generate() makes one). "
            "A cache written by the unpatched model cannot be continued patched: re-run the prompt.")
    if cache.fingerprint != fingerprint:
        raise PatchKVError(f"This LatentCache was written under another patch ({cache.plan_description}); "
                           "continuing it with different bases or methods would mix incompatible latents. "
                           "Start from a new patchkv.LatentCache(model).")
    return cache


def no_salient(keys: torch.Tensor, values: torch.Tensor, salience: Salience | None = None) -> dict[str, torch.Tensor]:
    """Empty salient regions, as `salience` holds its copies, for a layer whose keys and values are like `keys`,
    `values` `[batch, kv_heads, n, head_dim]` (a plan without salience, or a cache file written before salient regions
    existed)."""
    shape = (*keys.shape[:2], 0, 1)
    empty = _copies(_empty(keys), _empty(values), 16 if salience is None else salience.bits)
    return {"salient_keys": empty[0], "salient_values": empty[1],
            "salient_index": keys.new_zeros(shape, dtype=torch.int32),
            "salient_score": keys.new_zeros(shape, dtype=torch.float32), "salient_scale": empty[2]}


def _copies(keys: torch.Tensor, values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values `[batch, kv_heads, n, head_dim]` as a salience method holds its copies (and a window its
    tokens), and their scales `[batch, kv_heads, n, 2]` float32 (`methods.base.copy_layout`): at 16 bits the tensors
    themselves and no scale (width 0); at 8, int8 with a symmetric scale per token, head and kind (the largest
    magnitude at 127); at 4, the same at 7, each level stored as level + 8 in one half of a byte (even components in
    the low half)."""
    if bits == 16:
        return keys, values, keys.new_zeros((*keys.shape[:3], 0), dtype=torch.float32)
    if bits == 4 and keys.shape[-1] % 2:
        raise PatchKVError(f"int4 copies and windows hold two values a byte, so head_dim must be even; this model's "
                           f"is {keys.shape[-1]}: use bits=8.")
    top = 2 ** (bits - 1) - 1
    scales = [x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / top for x in (keys, values)]
    levels = [(x.float() / scale).round().clamp(-top, top) for x, scale in zip((keys, values), scales)]
    if bits == 8:
        codes = [x.to(torch.int8) for x in levels]
    else:
        codes = [(x + 8).to(torch.uint8) for x in levels]
        codes = [x[..., 0::2] | (x[..., 1::2] << 4) for x in codes]
    return codes[0], codes[1], torch.cat(scales, dim=-1)


def _read_copies(tensors: dict[str, torch.Tensor], region: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values of `region` ("salient" copies or the "recent" window) `[batch, kv_heads, s, head_dim]`
    in `dtype`, int8 and int4 ones scaled back by the region's scales."""
    keys, values, scale = tensors[f"{region}_keys"], tensors[f"{region}_values"], tensors[f"{region}_scale"]
    if not scale.shape[-1]:
        return keys, values
    if keys.dtype == torch.uint8:  # int4, two to a byte
        keys, values = (torch.stack([x & 15, x >> 4], dim=-1).flatten(-2).float() - 8 for x in (keys, values))
    return (keys.float() * scale[..., :1]).to(dtype), (values.float() * scale[..., 1:]).to(dtype)


def no_window_scale(keys: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scales of an exact window (width 0) for a layer whose window keys are `keys` `[batch, kv_heads, n,
    head_dim]` (a cache file written before int8 windows existed)."""
    return {WINDOW_SCALE: keys.new_zeros((*keys.shape[:3], 0), dtype=torch.float32)}


def no_kept(keys: torch.Tensor) -> dict[str, torch.Tensor]:
    """An empty kept-token bitmap for a layer whose keys are like `keys` `[batch, kv_heads, n, head_dim]` (no token
    has left its window; a plan without `Evict`, or a cache file written before eviction existed)."""
    return {KEPT: keys.new_zeros((keys.shape[0], 1, 0, 1), dtype=torch.uint8)}


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool `[batch, n]` -> the bitmap `[batch, 1, ceil(n / 8), 1]` uint8, bit `i` in byte `i // 8`, low bit first
    (the bits past n zero)."""
    batch, n = bits.shape
    padded = torch.zeros(batch, -(-n // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:, :n] = bits
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (padded.view(batch, -1, 8) * weights).sum(-1, dtype=torch.uint8).view(batch, 1, -1, 1)


def unpack_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    """The bitmap `[batch, 1, bytes, 1]` uint8 (`_pack_bits`) -> its first `n` bits, bool `[batch, n]`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    bits = (bitmap.view(bitmap.shape[0], -1, 1) >> shifts) & 1
    return bits.view(bitmap.shape[0], -1)[:, :n].bool()


def _append_bits(bitmap: torch.Tensor, n: int, bits: torch.Tensor) -> torch.Tensor:
    """The bitmap of `n` bits `[batch, 1, ceil(n / 8), 1]` with `bits` bool `[batch, m]` after them (only its last,
    partial byte is repacked)."""
    whole = n // 8
    if n % 8:
        bits = torch.cat([unpack_bits(bitmap[:, :, whole:], n % 8), bits], dim=1)
    return torch.cat([bitmap[:, :, :whole], _pack_bits(bits)], dim=2)


def _lowest_gone(score: torch.Tensor, drop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens scored `score` `[batch, n]` with the lowest `drop` of each sequence going (of equal scores the earlier):
    which stay, bool `[batch, n]`, and their indices in order, `[batch, n - drop]`."""
    batch, n = score.shape
    held = torch.ones(batch, n, dtype=torch.bool, device=score.device)
    held.scatter_(1, score.sort(dim=1, stable=True).indices[:, :drop], False)
    return held, held.nonzero()[:, 1].view(batch, n - drop)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x `[batch, heads, n, width]` at each sequence's tokens `index` `[batch, k]` -> `[batch, heads, k, width]`."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def no_near(lp: LayerPatch, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Empty near regions (as `lp`'s near codecs store them) for a layer whose keys and values are like `keys`,
    `values` `[batch, kv_heads, n, head_dim]` (a cache file written before near regions existed)."""
    return {"near_keys": lp.near_keys.empty(keys), "near_values": lp.near_values.empty(values)}


def _empty(x: torch.Tensor) -> torch.Tensor:
    """A zero-token tensor like `x` `[batch, kv_heads, n, head_dim]` with storage of its own (a view `x[:, :, :0]`
    would keep all of x's storage alive)."""
    return x.new_empty(*x.shape[:2], 0, x.shape[3])


def _unmoved(kept: torch.Tensor, score: torch.Tensor, capacity: int) -> bool:
    """Whether newcomers scored `score` `[batch, kv_heads, n, 1]` leave the kept tokens, scored `kept` `[batch,
    kv_heads, s, 1]`, as they are: the kept fill the `capacity` and no newcomer ranks above any of them (on equal
    scores the earlier kept stays, as `_best` keeps it). A decode step's lone token scores 0 under Novelty, so most
    steps skip copying, concatenating and ranking the kept tokens."""
    return kept.shape[2] == capacity and bool((score.float().amax(2) <= kept.amin(2)).all())


def _best(regions: dict[str, torch.Tensor], score: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The salient `regions` `[batch, kv_heads, s, ...]` cut to each KV head's `k` best by `score` `[batch,
    kv_heads, s]`, kept in their order; of equal scores the earlier kept first (the regions hold the kept tokens, then
    the newcomers)."""
    best = score.sort(dim=2, descending=True, stable=True).indices[:, :, :k].sort(dim=2).values.unsqueeze(-1)
    return {name: x.gather(2, best.expand(-1, -1, -1, x.shape[-1])) for name, x in regions.items()}
