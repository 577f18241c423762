"""The lossless stage: DEFLATE (zlib) over bytes that leave memory, and its bounded inverse.

Used by `patchkv.save_cache` (a saved cache's codes, byte column by byte column) and by `patchkv.prefix_store` (a
spilled block's bytes). `inflate` never produces more than the bytes its caller vouches for, so a damaged or hostile
stream (a DEFLATE bomb) stops there and is refused.
"""

from __future__ import annotations

import zlib

from .errors import PatchKVError

#: the stages a writer may ask for: None (bytes as they are) or "deflate"
COMPRESSIONS = (None, "deflate")


class InflateError(PatchKVError):
    """A DEFLATE stream that is damaged, or that does not inflate to exactly the bytes it was declared to hold."""


def check_compress(compress: str | None, level: int) -> None:
    """Raise ValueError unless `compress` is one of `COMPRESSIONS` and `level` a zlib level (0-9)."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be 'deflate' or None, got {compress!r}.")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 9:
        raise ValueError(f"a zlib level is an integer from 0 to 9, got {level!r}.")


def deflate(raw: bytes | memoryview, level: int = 6) -> bytes:
    """`raw` as one zlib stream at `level`."""
    return zlib.compress(raw, level)


def inflate(stream: bytes | memoryview, size: int) -> bytes:
    """The `size` bytes the zlib `stream` holds. Raises `InflateError` if it is damaged, holds fewer bytes, would
    inflate past `size` (nothing beyond `size` is produced), or has bytes after its end."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(stream, size)
    except zlib.error as e:
        raise InflateError(f"does not inflate ({e})") from e
    if len(raw) != size or inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise InflateError(f"inflates to other bytes than the {size} it was declared to hold")
    return raw
