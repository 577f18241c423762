"""A prefix cache's blocks under a byte budget, least recently used evicted first; engine-independent.

A block of a prompt is named by its key: the hash of the key of the block before it and its own token ids, from a
root that names the codec (`block_keys`), so equal keys mean the same tokens from the start of the sequence, coded
the same way. `PrefixStore` holds a value per key and the bytes each takes, and never holds more than its
`capacity` bytes: admitting a block evicts the least recently used ones until it fits, and a block larger than the
whole budget is refused. An engine keeps the bytes in one process (its worker) and decides what is kept in another
(its scheduler): both use this class, the scheduler with sizes only (value None).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

Value = TypeVar("Value")


def block_keys(root: bytes, token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """The key of every full block of `token_ids` (`len // block_tokens` of them): 16 bytes each, chained from
    `root`."""
    keys, parent = [], root
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[start:start + block_tokens]))
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixStore(Generic[Value]):
    """Values (a block's bytes, or None where only the size is tracked) by key, at most `capacity` bytes in all."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"a store's capacity is a number of bytes >= 0, got {capacity}.")
        self.capacity = capacity
        self._held: OrderedDict[bytes, tuple[Value, int]] = OrderedDict()
        self.held_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        return list(self._held)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are held without a gap (a prefix's hit, in blocks). Touches nothing."""
        count = 0
        while count < len(keys) and keys[count] in self._held:
            count += 1
        return count

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held `keys` as just used (the first of them evicted last)."""
        for key in reversed(keys):
            if key in self._held:
                self._held.move_to_end(key)

    def get(self, key: bytes) -> Value | None:
        """The value held for `key` (marked just used), or None."""
        if key not in self._held:
            return None
        self._held.move_to_end(key)
        return self._held[key][0]

    def put(self, key: bytes, value: Value, size: int) -> list[bytes] | None:
        """Hold `value` of `size` bytes under `key` (replacing what was there), evicting the least recently used
        until it fits -> the evicted keys, or None when `size` exceeds the whole capacity (nothing changes)."""
        if size > self.capacity:
            return None
        self.discard(key)
        evicted = []
        while self.held_bytes + size > self.capacity:
            old, (_, old_size) = self._held.popitem(last=False)
            self.held_bytes -= old_size
            evicted.append(old)
        self._held[key] = (value, size)
        self.held_bytes += size
        return evicted

    def discard(self, key: bytes) -> bool:
        """Drop `key` if held -> whether it was."""
        if key not in self._held:
            return False
        self.held_bytes -= self._held.pop(key)[1]
        return True
