"""Exceptions raised by patchkv. Every message says what was expected, what was found, and how to fix it."""


class PatchKVError(Exception):
    """Base class for all patchkv errors."""


class UnsupportedModelError(PatchKVError):
    """The model's architecture has no adapter."""


class ArtifactError(PatchKVError):
    """An artifact file is unreadable: truncated, corrupted, or of an unknown format version."""


class IncompatibleArtifactError(PatchKVError):
    """The artifact was calibrated for a different model (layers, head dim, KV heads, dtype, ...)."""


class AlreadyPatchedError(PatchKVError):
    """`apply` was called on a model that is already patched."""
