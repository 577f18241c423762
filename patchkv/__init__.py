"""patchkv: shrink the KV cache of Hugging Face decoder models with calibrated PCA bases.

    artifact = patchkv.calibrate(model, texts, tokenizer=tok, mode="pre_rope", energy=0.9)
    artifact.save("bases/")
    patchkv.apply(model, patchkv.Artifact.load("bases/"))   # generate() now keeps a patchkv.LatentCache
    patchkv.remove(model)                                   # back to the original model
"""

from .adapters import SUPPORTED_MODEL_TYPES
from .artifact import Artifact
from .artifact_format import FORMAT_VERSION
from .cache import LatentCache, LatentLayer
from .cache_file import load_cache, save_cache
from .calibrate import calibrate
from .errors import (AlreadyPatchedError, ArtifactError, IncompatibleArtifactError, PatchKVError,
                     UnsupportedModelError)
from .methods import (METHODS, AttentionMass, CodeError, Evict, KeyNorm, LowRank, NearCodes, Novelty, Quantized,
                      SinksWindow, TopK, parse_method)
from .patching import apply, is_patched, patched, remove
from .step_scales import fit_step_scales

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION", "METHODS", "SUPPORTED_MODEL_TYPES", "AlreadyPatchedError", "Artifact", "ArtifactError",
    "AttentionMass",
    "CodeError", "Evict", "IncompatibleArtifactError", "KeyNorm", "LatentCache", "LatentLayer", "LowRank", "NearCodes",
    "Novelty", "PatchKVError", "Quantized",
    "SinksWindow", "TopK", "UnsupportedModelError", "apply", "calibrate", "fit_step_scales", "is_patched",
    "load_cache", "parse_method", "patched", "remove", "save_cache",
]
