"""A prefix cache's blocks under byte budgets, in memory and spilled to disk, least recently used evicted first;
engine-independent.

A block of a prompt is named by its key: the hash of the key of the block before it and its own token ids, from a
root that names the codec (`block_keys`), so equal keys mean the same tokens from the start of the sequence, coded
the same way. `PrefixStore` holds a value per key and the bytes each takes, and never holds more than its
`capacity` bytes in memory: admitting a block pushes the least recently used ones out until it fits, and a block
larger than the whole memory budget is refused. Without a `Spill`, a block pushed out is evicted; with one, it is
written to the spill folder (one file per block), which holds at most `Spill.capacity` bytes of files, its own least
recently used evicted first. A hit on a spilled block reads it back and moves it to memory (pushing others out to
disk); a spilled file that is damaged, truncated, or not the block its name says is refused: deleted and counted a
miss, never returned.

An engine keeps the bytes in one process (its worker) and decides what is kept in another (its scheduler): both use
this class, the scheduler with sizes only (`sizes_only=True`, values None), which runs the same admissions, spills
and evictions on sizes without touching the folder. A spilled block's file takes `SPILL_HEADER_BYTES` more than the
block, or fewer with the lossless stage (`Spill.compress="deflate"`): a sizes-only store counts the first, an upper
bound.

Spill files persist: a store opened on a folder that holds spill files (an engine restarted) finds them, least
recently written first, evicting past its disk budget; files whose header does not name their own key are deleted.
One store writes to a folder at a time.

Spill file format
=================
    magic     4 bytes   b"PKVS"
    version   1 byte    1
    encoding  1 byte    0: the block as it is, 1: DEFLATE (zlib) stream of it; then 2 zero bytes
    key       16 bytes  the block's key (the file is named by its hex)
    size      uint64    little-endian: the block's bytes (inflated)
    digest    16 bytes  blake2b of the key and the block's bytes
    payload   the block, or its zlib stream

Files are written to a temporary name and renamed into place (a reader never sees half a file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from .errors import PatchKVError
from .lossless import InflateError, check_compress, deflate, inflate

Value = TypeVar("Value")
logger = logging.getLogger(__name__)

SPILL_MAGIC = b"PKVS"
SPILL_VERSION = 1
_SPILL = struct.Struct("<4sBB2x16sQ16s")
#: bytes of a spill file's header: magic, version, encoding, key, size, digest
SPILL_HEADER_BYTES = _SPILL.size
_ENCODINGS = {None: 0, "deflate": 1}
#: bytes of a key (`block_keys`); a store that spills names its files by them
KEY_BYTES = 16
_NAME = re.compile(r"[0-9a-f]{32}\.pkvs")
_TEMPORARY = re.compile(r"\.[0-9a-f]{32}\.\d+\.tmp")


def block_keys(root: bytes, token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """The key of every full block of `token_ids` (`len // block_tokens` of them): 16 bytes each, chained from
    `root`."""
    keys, parent = [], root
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[start:start + block_tokens]))
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Spill:
    """A store's disk tier: `folder` (created if missing; the store's own), at most `capacity` bytes of spill files,
    each block DEFLATE-compressed at zlib `level` (`compress="deflate"`) or written as it is (`compress=None`)."""

    folder: Path
    capacity: int
    compress: str | None = None
    level: int = 6

    def __post_init__(self):
        object.__setattr__(self, "folder", Path(self.folder))
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ValueError(f"a spill's capacity is a number of bytes >= 0, got {self.capacity!r}.")
        check_compress(self.compress, self.level)


class SpillError(PatchKVError):
    """A spill file that is damaged, truncated, or not the block its name says."""


class PrefixStore(Generic[Value]):
    """Values (a block's bytes, or None where only the size is tracked) by key: at most `capacity` bytes in memory and,
    with a `spill`, at most `spill.capacity` bytes of files on disk (module docstring)."""

    def __init__(self, capacity: int, spill: Spill | None = None, *, sizes_only: bool = False):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"a store's capacity is a number of bytes >= 0, got {capacity!r}.")
        self.capacity, self.spill, self.sizes_only = capacity, spill, sizes_only
        self._held: OrderedDict[bytes, tuple[Value, int]] = OrderedDict()
        #: spilled blocks: their bytes (inflated) and their file's bytes, least recently used first
        self._spilled: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.held_bytes = 0
        self.disk_bytes = 0
        self._evicted: list[bytes] = []
        if spill is not None:
            if not sizes_only:
                spill.folder.mkdir(parents=True, exist_ok=True)
            self._reopen()

    def __contains__(self, key: bytes) -> bool:
        return key in self._held or key in self._spilled

    def __len__(self) -> int:
        return len(self._held) + len(self._spilled)

    def keys(self) -> list[bytes]:
        """Held keys: those on disk, then those in memory, each tier least recently used first."""
        return list(self._spilled) + list(self._held)

    def disk_keys(self) -> list[bytes]:
        """Keys of spilled blocks, least recently used first."""
        return list(self._spilled)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are held without a gap (a prefix's hit, in blocks). Touches nothing."""
        count = 0
        while count < len(keys) and keys[count] in self:
            count += 1
        return count

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held `keys` (a prefix's blocks, in order) as just used, the first of them evicted last. The leading
        ones that fit in memory together move there (spilled ones read back); the others keep their tier, so a hit
        larger than memory pushes none of its own blocks out to read them again (`peek` reads those)."""
        held = [key for key in keys if key in self]
        room, fit = self.capacity, 0
        while fit < len(held) and self._size(held[fit]) <= room:
            room -= self._size(held[fit])
            fit += 1
        lead, rest = held[:fit], held[fit:]
        for key in [*reversed(rest), *reversed(lead)]:  # in memory, the hit's blocks go last to be pushed out
            if key in self._held:
                self._held.move_to_end(key)
        for key in lead:                                 # those that fit together move to memory, pushing others
            if key in self._spilled:
                self._use(key)
        for key in reversed(rest):                       # the rest were just used too: the newest on disk
            if key in self._spilled:
                self._spilled.move_to_end(key)
        for key in reversed(lead):
            if key in self._held:
                self._held.move_to_end(key)

    def get(self, key: bytes) -> Value | None:
        """The value held for `key`, marked just used (read back into memory if spilled), or None: not held, or its
        spill file refused."""
        return self._held[key][0] if self._use(key) else None

    def peek(self, key: bytes) -> Value | None:
        """The value held for `key`, from memory or read from its spill file where it stays, marking nothing; None
        when not held or its spill file is refused (then dropped)."""
        if key in self._held:
            return self._held[key][0]
        if key not in self._spilled or self.sizes_only:
            return None
        return self._read_or_drop(key)

    def put(self, key: bytes, value: Value, size: int) -> bool:
        """Hold `value` of `size` bytes under `key` in memory (replacing what was there), pushing the least recently
        used out (to disk, or evicted) until it fits -> False when `size` exceeds the memory capacity (nothing
        changes)."""
        if self.spill is not None and len(key) != KEY_BYTES:
            raise ValueError(f"a store that spills to disk names blocks by {KEY_BYTES}-byte keys (block_keys), got "
                             f"{len(key)} bytes.")
        if size > self.capacity:
            return False
        self.discard(key)
        self._admit(key, value, size)
        return True

    def discard(self, key: bytes) -> bool:
        """Drop `key` if held, in memory or on disk -> whether it was."""
        if key in self._held:
            self.held_bytes -= self._held.pop(key)[1]
            return True
        if key in self._spilled:
            self._unspill(key)
            return True
        return False

    def take_evicted(self) -> list[bytes]:
        """Keys this store dropped on its own since the last call (pushed past its last tier, or a spill file
        refused), oldest first; `discard`ed keys are not among them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # ----- tiers ---------------------------------------------------------------------------------------------
    def _use(self, key: bytes) -> bool:
        if key in self._held:
            self._held.move_to_end(key)
            return True
        if key not in self._spilled:
            return False
        size = self._spilled[key][0]
        value = None if self.sizes_only else self._read_or_drop(key)
        if value is None and not self.sizes_only:
            return False
        self._unspill(key)
        self._admit(key, value, size)
        return True

    def _size(self, key: bytes) -> int:
        """A held block's bytes (in memory: the value's; spilled: inflated)."""
        return self._held[key][1] if key in self._held else self._spilled[key][0]

    def _read_or_drop(self, key: bytes) -> bytes | None:
        """The spilled block under `key`, or None when its file is refused: then it is dropped (and reported)."""
        try:
            return self._read(key)
        except (SpillError, OSError) as e:
            logger.warning("patchkv prefix store: spill file %s refused, counted a miss: %s", self._path(key), e)
            self._unspill(key)
            self._evicted.append(key)
            return None

    def _admit(self, key: bytes, value: Value, size: int) -> None:
        while self.held_bytes + size > self.capacity:
            old, (old_value, old_size) = self._held.popitem(last=False)
            self.held_bytes -= old_size
            self._spill_out(old, old_value, old_size)
        self._held[key] = (value, size)
        self.held_bytes += size

    def _spill_out(self, key: bytes, value: Value, size: int) -> None:
        """A block pushed out of memory: to disk if it fits the spill's capacity, else evicted."""
        spill = self.spill
        data = None
        if spill is not None and not self.sizes_only:
            data = self._frame(key, value)
        file_bytes = SPILL_HEADER_BYTES + size if data is None else len(data)
        if spill is None or file_bytes > spill.capacity:
            self._evicted.append(key)
            return
        while self.disk_bytes + file_bytes > spill.capacity:
            old = next(iter(self._spilled))
            self._unspill(old)
            self._evicted.append(old)
        if data is not None:
            try:
                self._write(key, data)
            except OSError as e:
                logger.warning("patchkv prefix store: could not spill a block to %s (%s); it is evicted",
                               spill.folder, e)
                self._evicted.append(key)
                return
        self._spilled[key] = (size, file_bytes)
        self.disk_bytes += file_bytes

    def _unspill(self, key: bytes) -> None:
        """Forget a spilled block and delete its file."""
        self.disk_bytes -= self._spilled.pop(key)[1]
        if not self.sizes_only:
            self._path(key).unlink(missing_ok=True)

    # ----- files ---------------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.spill.folder / f"{key.hex()}.pkvs"

    def _frame(self, key: bytes, value: Value) -> bytes:
        """A spill file's bytes for block `value` (bytes-like) under `key` (format in the module docstring)."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"a store that spills to disk holds bytes, got {type(value).__name__}.")
        raw = bytes(value)
        payload, compress = raw, self.spill.compress
        if compress == "deflate":
            payload = deflate(raw, self.spill.level)
            if len(payload) >= len(raw):  # incompressible: stored as it is
                payload, compress = raw, None
        header = _SPILL.pack(SPILL_MAGIC, SPILL_VERSION, _ENCODINGS[compress], key, len(raw), _digest(key, raw))
        return header + payload

    def _write(self, key: bytes, data: bytes) -> None:
        """`data` to the key's file, through a temporary file renamed into place."""
        path = self._path(key)
        temporary = path.with_name(f".{key.hex()}.{os.getpid()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise

    def _header(self, key: bytes, head: bytes) -> tuple[int, int, bytes]:
        """A spill file's header checked against `key` and the memory capacity -> (encoding, size, digest)."""
        if len(head) < SPILL_HEADER_BYTES:
            raise SpillError(f"{len(head)} bytes, shorter than a spill file's {SPILL_HEADER_BYTES}-byte header")
        magic, version, encoding, named, size, digest = _SPILL.unpack(head[:SPILL_HEADER_BYTES])
        if magic != SPILL_MAGIC or version != SPILL_VERSION or encoding not in _ENCODINGS.values():
            raise SpillError(f"not a patchkv spill file of version {SPILL_VERSION} (magic {magic!r}, version "
                             f"{version}, encoding {encoding})")
        if named != key:
            raise SpillError(f"it holds block {named.hex()}, not the {key.hex()} its name says")
        if size > self.capacity:
            raise SpillError(f"its block of {size} bytes exceeds the store's memory capacity of {self.capacity}")
        return encoding, size, digest

    def _read(self, key: bytes) -> bytes:
        """The block spilled under `key`, checked (header, size, digest). Raises SpillError or OSError."""
        data = self._path(key).read_bytes()
        encoding, size, digest = self._header(key, data)
        payload = memoryview(data)[SPILL_HEADER_BYTES:]
        if encoding == _ENCODINGS["deflate"]:
            try:
                raw = inflate(payload, size)
            except InflateError as e:
                raise SpillError(f"its DEFLATE stream {e}") from e
        elif len(payload) != size:
            raise SpillError(f"it holds {len(payload)} bytes of a {size}-byte block: truncated or damaged")
        else:
            raw = bytes(payload)
        if _digest(key, raw) != digest:
            raise SpillError("its digest does not match its bytes: damaged")
        return raw

    def _reopen(self) -> None:
        """Index the spill files already in the folder, least recently written first, then evict past the disk
        budget; delete leftover temporary files and files whose header does not name their own key (a store with
        sizes only skips those and deletes nothing)."""
        folder = self.spill.folder
        found = []
        for entry in (os.scandir(folder) if folder.is_dir() else ()):
            if not self.sizes_only and _TEMPORARY.fullmatch(entry.name):
                Path(entry.path).unlink(missing_ok=True)
            if not _NAME.fullmatch(entry.name) or not entry.is_file():
                continue
            key = bytes.fromhex(entry.name[:32])
            try:
                with open(entry.path, "rb") as f:
                    size = self._header(key, f.read(SPILL_HEADER_BYTES))[1]
                stat = entry.stat()
            except (SpillError, OSError) as e:
                if not self.sizes_only:
                    logger.warning("patchkv prefix store: spill file %s refused and deleted: %s", entry.path, e)
                    Path(entry.path).unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, entry.name, key, size, stat.st_size))
        for *_, key, size, file_bytes in sorted(found):
            self._spilled[key] = (size, file_bytes)
            self.disk_bytes += file_bytes
        while self.disk_bytes > self.spill.capacity:
            self._unspill(next(iter(self._spilled)))


def _digest(key: bytes, raw: bytes) -> bytes:
    h = hashlib.blake2b(key, digest_size=16)
    h.update(raw)
    return h.digest()
