"""evals/research_precision.py (`python -m evals needle-precision`): its variants cover the kinds and the layers by
thirds, and reading a part at the near rate swaps exactly that part's codecs and stores it at that rate."""

import torch
from conftest import calibration_ids, make_model

import patchkv
from evals.research_precision import finer, variants


def test_the_variants_cover_every_kind_and_the_layers_by_thirds():
    parts = variants(30)
    assert parts["as is"] is None and parts["keys and values"] == (("keys", "values"), 0, 29)
    assert [parts[f"keys and values, layers {a}-{b}"][1:] for a, b in ((0, 9), (10, 19), (20, 29))] == \
        [(0, 9), (10, 19), (20, 29)]


def test_a_part_at_the_near_rate_is_stored_at_that_rate_and_only_it():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, progress=False)
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(16), patchkv.NearCodes(tokens=4, factor=4)]
    ids = calibration_ids(1, 40)
    with torch.no_grad(), patchkv.patched(model, artifact, methods):
        layers = model.patchkv.layers
        middle, near = layers[0].keys, layers[0].near_keys
        finer(model, ("keys",), 0, 0)
        assert layers[0].keys is near and layers[0].values is not layers[0].near_values
        assert all(lp.keys is not lp.near_keys for lp in layers[1:])
        cache = patchkv.LatentCache(model)
        model(input_ids=ids, cache=cache, use_cache=True)
        widths = [cache.layer(i).tensors["latent_keys"].shape[-1] for i in range(len(layers))]
        assert widths[0] == near.width > middle.width and set(widths[1:]) == {layers[1].keys.width}
