"""patchkv: shrink the KV cache of Hugging Face decoder models with calibrated PCA bases.

    artifact = patchkv.calibrate(model, texts, tokenizer=tok, mode="pre_rope", energy=0.9)
    artifact.save("bases/")
    patchkv.apply(model, patchkv.Artifact.load("bases/"))   # the cache now holds latents
    patchkv.remove(model)                                   # back to the original model
"""

from .adapters import SUPPORTED_MODEL_TYPES
from .artifact import FORMAT_VERSION, Artifact
from .calibrate import calibrate
from .errors import (AlreadyPatchedError, ArtifactError, IncompatibleArtifactError, PatchKVError,
                     UnsupportedModelError)
from .patching import apply, is_patched, patched, remove

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION", "SUPPORTED_MODEL_TYPES", "AlreadyPatchedError", "Artifact", "ArtifactError",
    "IncompatibleArtifactError", "PatchKVError", "UnsupportedModelError", "apply", "calibrate", "is_patched",
    "patched", "remove",
]
