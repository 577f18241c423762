"""Blocks of keys and values as an engine holds them, to patchkv codes and back: no model patch.

An engine (vLLM) keeps each layer's keys after the rotary embedding, a block of `block_tokens` tokens at a time,
`[block_tokens, kv_heads, head_dim]`. `BlockCodec` turns one block of every layer into bytes with an artifact and a
budget, and those bytes back into keys and values, to store a prefix off the accelerator and load it instead of
recomputing it:

    codec = BlockCodec.from_budget(Artifact.load("artifacts/smollm2-bases/pre_rope.safetensors"), "8x",
                                   rotations=Rotations.from_config(config))
    data = codec.encode([(keys, values) for each layer], positions)     # len(data) == codec.block_bytes(tokens)
    layers = codec.decode(data, positions)                             # [(keys, values), ...] in codec.dtype

A pre-RoPE artifact describes keys before the rotation: each key is turned back by its token's true position
(`positions`, which the block knows from its place in the sequence) before it is coded, and turned forward again
after decoding (`Rotations`: the model's own cos/sin, by its adapter). A post-RoPE artifact codes the keys as held.
The attention sinks, tokens at positions below `sink_tokens` (4, as budgets keep them: their keys and values are
outliers the bases were calibrated without), are stored exact in `dtype`.

Format of one block
===================
    magic        4 bytes   b"PKVB"
    version      1 byte    1, then 3 zero bytes
    fingerprint  16 bytes  blake2b of the artifact checksum, the method spec, the mode and the decoded dtype
    tokens       uint32    little-endian
    digest       16 bytes  blake2b of the fingerprint, the positions (int64) and the payload
    payload      for each layer: the sinks' keys then values `[sinks, kv_heads, head_dim]` in `dtype`, then the other
                 tokens' key codes `[coded, width]`, then their value codes, as bytes

The codes are fixed-rate, so a block of `n` tokens, `s` of them sinks, is exactly `HEADER_BYTES + s * sink_bytes +
(n - s) * token_bytes` bytes (`block_bytes`). A ratio budget ("8x") counts all of it: its bits are the most
whose stored prefixes, headers and sinks included, take at most the 16-bit cache's bytes / 8 per token
(`block_bits`), for every prefix of at least `prefix_tokens` (2048) tokens in the engine's blocks. `decode`
refuses (`BlockError`) a block written under another artifact or method, one decoded at other positions than it was
written for, and any damaged byte.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .adapters import AttentionAdapter, adapter_for, attention_modules
from .allocation import default_pool, full_kv_bytes_per_token, kv_bytes_per_token
from .artifact import Artifact
from .budgets import EXACT, most_bits, parse_budget
from .errors import PatchKVError
from .latent import Codec
from .methods import CodecMethod, Quantized, parse_method
from .rope import RopeTable, length_dependent

MAGIC = b"PKVB"
VERSION = 1
_HEADER = struct.Struct("<4sB3x16sI16s")
#: bytes of a block's header: magic, version, fingerprint, token count, digest
HEADER_BYTES = _HEADER.size
#: an engine's block size when none is given (vLLM's default)
BLOCK_TOKENS = 16
#: the shortest stored prefix a ratio budget holds for, everything counted (`block_bits`)
PREFIX_TOKENS = 2048


class BlockError(PatchKVError):
    """A stored block cannot be decoded: damaged, truncated, or written under another artifact, method or position."""


class Rotations:
    """The model's rotary embedding at any true positions, per layer: `rotate` applies it to keys `[n, kv_heads,
    head_dim]` and `unrotate` undoes it (the inverse rotation, by the same cos and -sin). Layers that share a table
    (every layer but Gemma 3's two kinds) share one `RopeTable`."""

    def __init__(self, adapter: AttentionAdapter, tables: list[RopeTable]):
        self.adapter, self.tables = adapter, tables

    @classmethod
    def from_model(cls, model: nn.Module) -> Rotations:
        """The tables of a loaded Hugging Face model, through its family's adapter (`patchkv.adapters`)."""
        adapter = adapter_for(model)
        rotary = adapter.rotary_embedding(model)
        kind = length_dependent(rotary)
        if kind is not None:
            raise ValueError(f"the model's RoPE type {kind!r} changes with the sequence length: one rotation per "
                             "position cannot undo it. Use a post_rope artifact.")
        shared: dict[object, RopeTable] = {}
        tables = []
        for attn in attention_modules(model, adapter):
            key = adapter.rope_key(attn)
            tables.append(shared.setdefault(key, RopeTable(adapter, rotary, attn)))
        return cls(adapter, tables)

    @classmethod
    def from_config(cls, config) -> Rotations:
        """The tables from a Hugging Face config alone (what an engine has): the model is built on the meta device (no
        weights), its rotary embedding again on the CPU from the config (a few small buffers)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        adapter = adapter_for(skeleton)
        for name, module in skeleton.named_modules():
            if module is adapter.rotary_embedding(skeleton):
                skeleton.set_submodule(name, type(module)(skeleton.config))
                break
        return cls.from_model(skeleton)

    def _turn(self, layer: int, x: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = self.tables[layer].at(positions, like=x.float())
        heads_first = x.float().transpose(0, 1).unsqueeze(0)                     # [1, kv_heads, n, head_dim]
        out = self.adapter.rotate(heads_first, cos.unsqueeze(0), sign * sin.unsqueeze(0))
        return out.squeeze(0).transpose(0, 1)

    def rotate(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """keys `[n, kv_heads, head_dim]` before RoPE, positions int `[n]` -> float32 `[n, kv_heads, head_dim]`
        rotated as the model rotates them."""
        return self._turn(layer, keys, positions, 1.0)

    def unrotate(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """keys `[n, kv_heads, head_dim]` as the model rotated them at `positions` `[n]` -> float32, un-rotated."""
        return self._turn(layer, keys, positions, -1.0)


def prefix_bytes(tokens: int, token_bytes: int, sink_bytes: int, *, block_tokens: int, sink_tokens: int) -> int:
    """Bytes a prefix of `tokens` tokens takes stored in blocks of `block_tokens` (the last may be partial): a
    header per block, the first `sink_tokens` tokens exact at `sink_bytes` each, every other token's codes at
    `token_bytes`."""
    sinks = min(sink_tokens, tokens)
    return -(-tokens // block_tokens) * HEADER_BYTES + sinks * sink_bytes + (tokens - sinks) * token_bytes


def block_bits(artifact: Artifact, ratio: float, pool: str, basis: str = "head", *, block_tokens: int = BLOCK_TOKENS,
               prefix_tokens: int = PREFIX_TOKENS, sink_tokens: int = EXACT[0], element_size: int = 2) -> int:
    """The most bits per KV head (average) such that every stored prefix of whole `block_tokens`-token blocks, at
    least `prefix_tokens` tokens long, takes at most the 16-bit cache's bytes / `ratio` per token with everything
    counted: each block's header, the `sink_tokens` exact sinks (`element_size` bytes per element) and the codes
    (`prefix_bytes`). The sinks are paid once per prefix, so a longer one takes fewer bytes per token: the shortest
    such prefix is the one that must fit. Raises ValueError when even 1 bit does not fit."""
    if block_tokens < 1 or prefix_tokens < 1:
        raise ValueError(f"block_tokens and prefix_tokens must be >= 1, got {block_tokens} and {prefix_tokens}.")
    tokens = -(-prefix_tokens // block_tokens) * block_tokens
    allowed = full_kv_bytes_per_token(artifact, element_size=2) / ratio * tokens
    sink_bytes = full_kv_bytes_per_token(artifact, element_size)

    def fits(bits: int) -> bool:
        token_bytes = kv_bytes_per_token(artifact, bits, pool, basis)
        return prefix_bytes(tokens, token_bytes, sink_bytes, block_tokens=block_tokens,
                            sink_tokens=sink_tokens) <= allowed

    if not fits(1):
        raise ValueError(f"a {ratio:g}x budget allows {allowed / tokens:.0f} bytes per token over a prefix of "
                         f"{tokens} tokens, less than {sink_tokens} exact sinks, the blocks' headers and 1 bit per KV "
                         "head take; use a smaller ratio, fewer sinks or a longer prefix_tokens.")
    return most_bits(fits, artifact.head_dim * 8)


def block_method(artifact: Artifact, text: str, *, block_tokens: int = BLOCK_TOKENS, prefix_tokens: int = PREFIX_TOKENS,
                 sink_tokens: int = EXACT[0], element_size: int = 2, basis: str = "head") -> CodecMethod:
    """A budget ("8x" against the 16-bit cache, everything counted over prefixes of at least `prefix_tokens` in
    `block_tokens`-token blocks with `sink_tokens` exact sinks (`block_bits`), or "119" bits per KV head and token)
    as the `Quantized` codes a block stores on `basis` ("head" or "layer": the artifact's layer bases), or a codec
    method's spec ("lowrank:rank=64", "quantized:bits=96,basis=layer")."""
    if ":" in text or text.strip().lower() in ("lowrank", "quantized"):
        method = parse_method(text.strip())
        if not isinstance(method, CodecMethod):
            raise ValueError(f"{text!r} is a {method.role} method; a block stores codes: give a budget such as 8x or a "
                             "codec method (lowrank:..., quantized:...).")
        return method
    budget = parse_budget(text)
    for extra in (budget.salience, budget.near, budget.evict):
        if extra is not None:
            raise ValueError(f"budget {text!r}: a stored block is coded at one rate, every token kept, without salient "
                             f"or near tokens; drop '+{extra.spec()}'.")
    pool = budget.pool or default_pool(artifact)
    bits = budget.bits
    if bits is None:
        bits = block_bits(artifact, budget.ratio, pool, basis, block_tokens=block_tokens,
                          prefix_tokens=prefix_tokens, sink_tokens=sink_tokens, element_size=element_size)
    return Quantized(bits, pool=pool, basis=basis)


@dataclass(frozen=True)
class LayerCodes:
    """One layer's key and value codecs, and the bytes each takes per token."""

    keys: Codec
    values: Codec

    @property
    def token_bytes(self) -> int:
        return self.keys.bytes_per_token() + self.values.bytes_per_token()


class BlockCodec:
    """Encode and decode blocks of keys and values of every layer with `method`'s codecs on `artifact`'s bases.

    Codecs compute in float32 (low-rank latents are stored in float32); decoded keys and values are `dtype`, the
    engine's cache dtype, in which the `sink_tokens` first positions are stored exact. A pre-RoPE artifact needs
    `rotations`."""

    def __init__(self, artifact: Artifact, method: CodecMethod, rotations: Rotations | None = None,
                 dtype: torch.dtype = torch.bfloat16, sink_tokens: int = EXACT[0]):
        if artifact.mode == "pre_rope" and rotations is None:
            raise ValueError("a pre_rope artifact codes keys before the rotation: pass rotations= "
                             "(Rotations.from_model(model) or Rotations.from_config(config)), or use a post_rope "
                             "artifact.")
        if rotations is not None and len(rotations.tables) != artifact.num_layers:
            raise ValueError(f"rotations cover {len(rotations.tables)} layers, the artifact {artifact.num_layers}.")
        self.artifact, self.method, self.dtype, self.sink_tokens = artifact, method, dtype, sink_tokens
        self.rotations = rotations if artifact.mode == "pre_rope" else None
        codecs = method.codecs(artifact, [1] * artifact.num_layers, torch.float32)
        if codecs[0][0].span > 1:
            raise ValueError(f"{method.spec()} codes on layer bases spanning {codecs[0][0].span} layers, and a block "
                             "holds each layer's codes on its own: use basis='head', or an artifact calibrated with "
                             "layers_per_basis=1.")
        self.layers = [LayerCodes(k, v) for k, v in codecs]
        self.token_bytes = sum(layer.token_bytes for layer in self.layers)
        #: bytes of one exact sink token, keys and values of every layer
        self.sink_bytes = full_kv_bytes_per_token(artifact, torch.empty(0, dtype=dtype).element_size())
        identity = f"{artifact.metadata()['checksum']}|{method.spec()}|{artifact.mode}|{dtype}|{sink_tokens}".encode()
        self.fingerprint = hashlib.blake2b(identity, digest_size=16).digest()

    @classmethod
    def from_budget(cls, artifact: Artifact, budget: str, rotations: Rotations | None = None,
                    dtype: torch.dtype = torch.bfloat16, sink_tokens: int = EXACT[0], *,
                    block_tokens: int = BLOCK_TOKENS, prefix_tokens: int = PREFIX_TOKENS, basis: str = "head"
                    ) -> BlockCodec:
        """The codec for a budget or codec spec (`block_method`, codes on `basis`): a ratio holds, everything counted,
        for every prefix of at least `prefix_tokens` tokens stored in `block_tokens`-token blocks."""
        size = torch.empty(0, dtype=dtype).element_size()
        method = block_method(artifact, budget, block_tokens=block_tokens, prefix_tokens=prefix_tokens,
                              sink_tokens=sink_tokens, element_size=size, basis=basis)
        return cls(artifact, method, rotations, dtype, sink_tokens)

    def describe(self) -> str:
        return (f"{self.method.spec()} on {self.artifact.mode} bases, {self.token_bytes} bytes per token, "
                f"{self.sink_tokens} sinks exact")

    def sinks(self, positions: torch.Tensor) -> int:
        """How many of a block's tokens are exact sinks: those at positions below `sink_tokens` (they lead a block,
        whose positions ascend)."""
        return int((positions < self.sink_tokens).sum())

    def block_bytes(self, positions: torch.Tensor) -> int:
        """Exactly the bytes `encode` returns for a block of tokens at `positions` `[n]`."""
        sinks = self.sinks(positions)
        return HEADER_BYTES + sinks * self.sink_bytes + (positions.shape[0] - sinks) * self.token_bytes

    # ----- one layer ---------------------------------------------------------------------------------------------
    def layer_bytes(self, layer: int, positions: torch.Tensor) -> int:
        """Bytes of one layer's payload for tokens at `positions` `[n]`."""
        sinks = self.sinks(positions)
        exact = self.sink_bytes // self.artifact.num_layers  # one token's keys and values of one layer
        return sinks * exact + (positions.shape[0] - sinks) * self.layers[layer].token_bytes

    def encode_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> bytes:
        """keys (rotated, as the engine holds them) and values `[n, kv_heads, head_dim]`, true positions int `[n]` ->
        the layer's payload (`layer_bytes`)."""
        s = self.sinks(positions)
        out = b"".join(_raw(x[:s].to(self.dtype)) for x in (keys, values))
        keys, values, positions = keys[s:], values[s:], positions[s:]
        codes = self.layers[layer]
        if self.rotations is not None:
            keys = self.rotations.unrotate(layer, keys, positions)
        for codec, x in ((codes.keys, keys), (codes.values, values)):
            stored = codec.encode(x.float().transpose(0, 1).unsqueeze(0))          # [1, 1, coded, width]
            out += _raw(stored.reshape(x.shape[0], -1))
        return out

    def decode_layer(self, layer: int, payload: bytes | memoryview, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's payload and its tokens' true positions `[n]` -> keys (rotated) and values `[n, kv_heads,
        head_dim]` in `dtype`."""
        s, shape = self.sinks(positions), (self.artifact.num_kv_heads, self.artifact.head_dim)
        exact = s * shape[0] * shape[1] * torch.empty(0, dtype=self.dtype).element_size()
        sinks = [_tensor(payload[i * exact:(i + 1) * exact], self.dtype).view(s, *shape) for i in range(2)]
        payload, positions = payload[2 * exact:], positions[s:]
        codes, n = self.layers[layer], positions.shape[0]
        split = n * codes.keys.bytes_per_token()
        out = []
        for codec, part in ((codes.keys, payload[:split]), (codes.values, payload[split:])):
            stored = _tensor(part, codec.stored_dtype).view(1, 1, n, codec.width)
            coeffs = codec.decode(stored).float()                                    # [1, kv_heads, n, max_rank]
            basis = codec.basis
            x = coeffs @ basis.float_basis.transpose(1, 2) + basis.float_mean.unsqueeze(1)
            out.append(x.squeeze(0).transpose(0, 1))                                # [n, kv_heads, head_dim]
        keys, values = out
        if self.rotations is not None:
            keys = self.rotations.rotate(layer, keys, positions)
        return tuple(torch.cat([exact_part, coded.to(self.dtype)]) for exact_part, coded in zip(sinks, (keys, values)))

    # ----- a whole block ---------------------------------------------------------------------------------------
    def encode(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> bytes:
        """Keys and values `[n, kv_heads, head_dim]` of every layer, in order, and the tokens' true positions int
        `[n]`, ascending -> the block's bytes (module docstring), exactly `block_bytes(positions)` long."""
        if len(layers) != len(self.layers):
            raise ValueError(f"a block holds every layer: got {len(layers)}, the artifact has {len(self.layers)}.")
        n = positions.shape[0]
        if n > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("a block's positions must ascend (its tokens in sequence order).")
        shape = (n, self.artifact.num_kv_heads, self.artifact.head_dim)
        for i, (k, v) in enumerate(layers):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)}, expected {shape} "
                                 "([tokens, kv_heads, head_dim], one per position).")
        payload = b"".join(self.encode_layer(i, k, v, positions) for i, (k, v) in enumerate(layers))
        return _HEADER.pack(MAGIC, VERSION, self.fingerprint, n, self._digest(positions, payload)) + payload

    def decode(self, data: bytes | memoryview, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A block's bytes and its tokens' true positions `[n]` -> keys (rotated) and values `[n, kv_heads,
        head_dim]` per layer. Raises `BlockError` unless the block was written by this codec, for these positions,
        and arrived intact."""
        data = memoryview(data)
        n = positions.shape[0]
        if len(data) != self.block_bytes(positions):
            raise BlockError(f"a block of {n} tokens takes {self.block_bytes(positions)} bytes under "
                             f"{self.describe()}; got {len(data)}: truncated, or written under another codec.")
        magic, version, fingerprint, tokens, digest = _HEADER.unpack(data[:HEADER_BYTES])
        if magic != MAGIC or version != VERSION:
            raise BlockError(f"not a patchkv block of version {VERSION} (magic {bytes(magic)!r}, version {version}).")
        if fingerprint != self.fingerprint:
            raise BlockError("the block was written under another artifact, method or dtype than "
                             f"{self.describe()}; it is refused.")
        payload = data[HEADER_BYTES:]
        if tokens != n or digest != self._digest(positions, payload):
            raise BlockError(f"the block's digest does not match its bytes at these {n} positions: it is damaged, or "
                             "it was written for other positions; it is refused.")
        out, start = [], 0
        for i in range(len(self.layers)):
            size = self.layer_bytes(i, positions)
            out.append(self.decode_layer(i, payload[start:start + size], positions))
            start += size
        return out

    def _digest(self, positions: torch.Tensor, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(self.fingerprint, digest_size=16)
        h.update(positions.to(torch.int64).contiguous().numpy().tobytes())
        h.update(payload)
        return h.digest()



def _raw(x: torch.Tensor) -> bytes:
    """A tensor's bytes, row-major."""
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """`data` as a flat tensor of `dtype` (a copy: the block's bytes stay untouched)."""
    if not len(data):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
