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


class InvalidArtifactError(ArtifactError, ValueError):
    """An artifact's contents break the format spec: wrong metadata types, non-finite values, non-orthonormal
    eigenvectors, unsorted or negative eigenvalues, ranks out of range. Raised at construction and at load; also a
    `ValueError`, which `Artifact(...)` raised for such defects before this class existed."""


class HubError(ArtifactError):
    """An artifact could not be fetched from (or pushed to) the Hugging Face Hub: unknown repo, revision or file,
    no network, or a download that stays corrupted after one fresh re-download."""
