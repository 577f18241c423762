"""save_cache / load_cache: a prefix cache written to disk (its codes DEFLATE-compressed) and read back continues
exactly as the cache it was saved from; files written under another patch, or damaged, are refused."""

import json

import pytest
import torch
from conftest import calibration_ids, make_model
from safetensors import safe_open
from safetensors.torch import save_file

import patchkv
from patchkv.cache_file import FORMAT, load_cache, save_cache
from patchkv.step_scales import with_step_scales


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)
    return model, artifact


def prefix(model, ids):
    """The cache after `ids` `[batch, seq]` went through the patched model in two forwards (so a middle is coded)."""
    out = model(ids[:, :20], use_cache=True)
    return model(ids[:, 20:], cache=out.cache, use_cache=True).cache


def continued(model, cache, ids):
    """Logits of `ids` fed one token per forward after `cache`."""
    return torch.cat([model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(ids.shape[1])], 1)


@pytest.mark.parametrize("compress", ["deflate", None])
@pytest.mark.parametrize("methods", [[patchkv.SinksWindow(2, 4), patchkv.Quantized(24)], [patchkv.SinksWindow(2, 4)],
                                     [patchkv.SinksWindow(2, 4), patchkv.Quantized(24), patchkv.CodeError(0.2)],
                                     [patchkv.SinksWindow(2, 4), patchkv.Quantized(24), patchkv.Novelty(0.2, bits=8)],
                                     [patchkv.SinksWindow(2, 4, bits=4), patchkv.Quantized(24),
                                      patchkv.Novelty(0.2, bits=4)]],
                         ids=["codes", "lowrank", "salient", "salient-int8", "int4"])
def test_a_saved_cache_continues_exactly_as_the_one_it_was_saved_from(tmp_path, setup, compress, methods):
    model, artifact = setup
    ids, more = calibration_ids(2, 40, seed=5), calibration_ids(2, 6, seed=6)
    with patchkv.patched(model, artifact, methods):
        cache = prefix(model, ids)
        saved = save_cache(cache, tmp_path / "prefix.safetensors", compress=compress)
        restored = load_cache(model, saved.path)
        assert restored.get_seq_length() == cache.get_seq_length() == 40
        assert restored.nbytes() == cache.nbytes() == saved.held_bytes
        for mine, theirs in zip(restored.layers, cache.layers):
            assert mine.tensors.keys() == theirs.tensors.keys()
            assert all(torch.equal(mine.tensors[n], theirs.tensors[n]) for n in mine.tensors)
        assert torch.equal(continued(model, restored, more), continued(model, cache, more))
    coded = any(isinstance(m, patchkv.Quantized) for m in methods)
    with safe_open(str(saved.path), framework="pt") as f:
        encodings = {r["encoding"] for layer in json.loads(f.metadata()[FORMAT])["layers"]
                     for r in layer["regions"].values()}
    assert encodings == ({"raw", "deflate"} if coded and compress else {"raw"})
    assert (saved.code_bytes > 0) == coded
    if not compress:
        assert saved.code_ratio == 1.0


def test_deflate_takes_back_what_a_widened_step_leaves_unused(tmp_path, setup):
    """With every step 3x the Gaussian-matched one, almost every coefficient falls in the inner levels: the fixed-rate
    codes waste bits the lossless stage recovers (the ratio is measured, not assumed: 1.0 would fail)."""
    model, artifact = setup
    ratios = []
    for scale in (1.0, 3.0):
        widened = with_step_scales(artifact, scale, scale, bits=48, pool="head")
        with patchkv.patched(model, widened, [patchkv.SinksWindow(2, 4), patchkv.Quantized(48)]):
            cache = prefix(model, calibration_ids(2, 200, seed=7))
            ratios.append(save_cache(cache, tmp_path / f"s{scale}.safetensors").code_ratio)
    assert ratios[1] > 1.2 > ratios[0]


def test_a_cache_from_another_patch_or_a_damaged_file_is_refused(tmp_path, setup):
    model, artifact = setup
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        saved = save_cache(prefix(model, calibration_ids(1, 40, seed=5)), tmp_path / "p.safetensors")
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(32)]):
        with pytest.raises(patchkv.PatchKVError, match="another patch"):
            load_cache(model, saved.path)
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        with safe_open(str(saved.path), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        stream = tensors["layers.0.latent_keys"].clone()
        stream[len(stream) // 2] ^= 0xFF
        save_file({**tensors, "layers.0.latent_keys": stream}, str(tmp_path / "bad.safetensors"), metadata=meta)
        with pytest.raises(patchkv.PatchKVError, match="layers.0.latent_keys"):
            load_cache(model, tmp_path / "bad.safetensors")
        shaped = json.loads(meta[FORMAT])
        shaped["layers"][1]["regions"]["sink_keys"]["shape"][2] += 1
        save_file(tensors, str(tmp_path / "shape.safetensors"), metadata={FORMAT: json.dumps(shaped)})
        with pytest.raises(patchkv.PatchKVError, match="layers.1.sink_keys"):
            load_cache(model, tmp_path / "shape.safetensors")
        save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
        with pytest.raises(patchkv.PatchKVError, match="not written by patchkv.save_cache"):
            load_cache(model, tmp_path / "other.safetensors")


def test_salient_regions_are_checked_and_a_version_1_file_loads_with_none(tmp_path, setup):
    model, artifact = setup
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(24), patchkv.Novelty(0.2)]
    with patchkv.patched(model, artifact, methods):
        saved = save_cache(prefix(model, calibration_ids(1, 40, seed=5)), tmp_path / "p.safetensors")
        with safe_open(str(saved.path), framework="pt") as f:
            meta, tensors = json.loads(f.metadata()[FORMAT]), {k: f.get_tensor(k) for k in f.keys()}
        index = tensors["layers.1.salient_index"].clone()
        index[0, 0, 0] = 10_000  # past the middle
        save_file({**tensors, "layers.1.salient_index": index}, str(tmp_path / "far.safetensors"),
                  metadata={FORMAT: json.dumps(meta)})
        with pytest.raises(patchkv.PatchKVError, match="layer 1's salient regions"):
            load_cache(model, tmp_path / "far.safetensors")
    with patchkv.patched(model, artifact, methods[:2]):  # written before the kept-token bitmap (version 5), window
        # scales (4), salient scales (3), near regions (2) and salient regions (1)
        saved = save_cache(prefix(model, calibration_ids(1, 40, seed=5)), tmp_path / "v3.safetensors")
        with safe_open(str(saved.path), framework="pt") as f:
            meta, tensors = json.loads(f.metadata()[FORMAT]), {k: f.get_tensor(k) for k in f.keys()}
        for version, absent in ((5, ("evict_",)), (4, ("recent_scale", "evict_")),
                                (3, ("salient_scale", "recent_scale", "evict_")),
                                (2, ("near_", "salient_scale", "recent_scale", "evict_")),
                                (1, ("near_", "salient_", "recent_scale", "evict_"))):
            old = json.loads(json.dumps(meta))
            old["format_version"] = version
            for layer in old["layers"]:
                layer["regions"] = {k: v for k, v in layer["regions"].items() if not k.startswith(absent)}
            save_file({k: t for k, t in tensors.items() if not any(f".{a}" in k for a in absent)},
                      str(tmp_path / f"v{version}.safetensors"), metadata={FORMAT: json.dumps(old)})
            restored = load_cache(model, tmp_path / f"v{version}.safetensors")
            assert restored.nbytes() == saved.held_bytes
            assert all(layer.salient_len == layer.near_len == 0 for layer in restored.layers)


def edited(path, out, edit) -> str:
    """A copy of the cache file `path` at `out` after `edit(meta, tensors)` changed its metadata and tensors."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()[FORMAT]), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(out), metadata={FORMAT: json.dumps(meta)})
    return out


def region(name, t):
    """An edit that replaces region `name` with `t` (stored raw, its entry updated)."""
    def edit(meta, tensors):
        i, r = name.split(".")[1:]
        meta["layers"][int(i)]["regions"][r] = {"shape": list(t.shape), "dtype": str(t.dtype)[6:], "encoding": "raw"}
        tensors[name] = t.contiguous()
    return edit


def test_a_file_is_checked_as_a_whole_against_the_patch(tmp_path, setup):
    """Each file below is consistent region by region with its own metadata, and would load and continue with wrong
    logits (or fail later with a raw error) if regions were checked only against their entries: every one is
    refused, naming what the patch expects."""
    model, artifact = setup
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        saved = save_cache(prefix(model, calibration_ids(1, 40, seed=5)), tmp_path / "p.safetensors", compress=None)
        with safe_open(str(saved.path), framework="pt") as f:
            codes, recent = f.get_tensor("layers.0.latent_keys"), f.get_tensor("layers.1.recent_values")

        def no_layer_1(meta, tensors):
            meta["layers"][1]["regions"] = {}

        def seen(n, layers):
            def edit(meta, tensors):
                for i in layers:
                    meta["layers"][i]["cumulative_length"] = n
            return edit

        cases = {"one component": (region("layers.0.latent_keys", codes[..., :1]), "layer 0 holds the keys' "),
                 "float32 codes": (region("layers.0.latent_keys", codes.float()),
                                   r"as torch.uint8 \[1, 1, tokens, 6\]"),
                 "wider codes": (region("layers.0.latent_keys", torch.cat([codes, codes], -1)), "layers.0.latent_keys"),
                 "no layer 1": (no_layer_1, r"layers \[1\] hold no regions while layers \[0\] do"),
                 "lengths": (seen(41, [0, 1]), r"position track is I32 \[1, 40\], expected I32 \(int32\) "
                                               r"\[batch, 41\]"),
                 "one length": (seen(39, [1]), r"disagree on the tokens seen \(cumulative_length \[40, 39\]"),
                 "a token short": (region("layers.1.recent_values", recent[:, :, 1:]), "different numbers of tokens"),
                 "batch": (region("layers.1.recent_values", recent.expand(2, -1, -1, -1)), r"\[1, 2, tokens, 16\]")}
        for name, (edit, message) in cases.items():
            with pytest.raises(patchkv.PatchKVError, match=message):
                load_cache(model, edited(saved.path, tmp_path / f"{name}.safetensors", edit))
        assert load_cache(model, saved.path).nbytes() == saved.held_bytes


def test_a_cache_with_sliding_layers_loads_and_continues_exactly(tmp_path):
    """Gemma 3's sliding layer (window 10) holds only its last tokens: the checks accept what it keeps."""
    model = make_model("gemma3")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, progress=False)
    ids, more = calibration_ids(2, 30, seed=5), calibration_ids(2, 4, seed=6)
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        cache = prefix(model, ids)
        assert {layer.is_sliding for layer in cache.layers} == {True, False}
        restored = load_cache(model, save_cache(cache, tmp_path / "s.safetensors").path)
        assert torch.equal(continued(model, restored, more), continued(model, cache, more))


def test_nothing_is_inflated_or_allocated_past_what_the_file_vouches_for(tmp_path, setup, monkeypatch):
    """A 50 KB stream declared as a 3 GB region is refused from the header (nothing inflated); a stream that inflates
    to 50 MB in place of a 204-byte region stops at its declared bytes (tracemalloc's peak stays far below 50 MB);
    positions past the model's context (2^31 - 1 would make the next forward build a 16 GiB RoPE table) or negative
    are refused, the last position inside it loads."""
    import tracemalloc
    import zlib

    model, artifact = setup
    with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        saved = save_cache(prefix(model, calibration_ids(1, 40, seed=5)), tmp_path / "p.safetensors")

        def bomb(meta, tensors):
            deflate = zlib.compressobj()
            stream = b"".join(deflate.compress(bytes(1 << 20)) for _ in range(50)) + deflate.flush()
            tensors["layers.0.latent_keys"] = torch.frombuffer(bytearray(stream), dtype=torch.uint8)

        def huge(meta, tensors):
            bomb(meta, tensors)
            for kind in ("keys", "values"):  # 3 GB each of 6-byte codes
                meta["layers"][0]["regions"][f"latent_{kind}"]["shape"][2] = 500_000_000

        def position(p):
            def edit(meta, tensors):
                tensors["positions"][0, -1] = p
            return edit

        with monkeypatch.context() as m:
            m.setattr(zlib, "decompressobj", None)  # anything inflated would fail with a TypeError
            with pytest.raises(patchkv.PatchKVError, match="layer 0 holds 2 sinks, 500000000 middle"):
                load_cache(model, edited(saved.path, tmp_path / "huge.safetensors", huge))
        path = edited(saved.path, tmp_path / "bomb.safetensors", bomb)
        tracemalloc.start()
        with pytest.raises(patchkv.PatchKVError, match="layers.0.latent_keys inflates to other bytes"):
            load_cache(model, path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 5 << 20
        for p in (2**31 - 1, 512, -1):  # the tiny llama's max_position_embeddings is 512
            with pytest.raises(patchkv.PatchKVError, match=rf"positions 0 to {max(p, 39)}|positions {p} to 38"):
                load_cache(model, edited(saved.path, tmp_path / f"at{p}.safetensors", position(p)))
        last = edited(saved.path, tmp_path / "at511.safetensors", position(511))
        assert load_cache(model, last).get_seq_length() == 40
