"""The artifact file: round trip, and every defect refused with a clear error, leaving the model unpatched."""

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model
from safetensors.torch import load_file, save_file

import patchkv
from patchkv.allocation import compression_ratio, full_kv_bytes_per_token, kv_bytes_per_token
from patchkv.artifact import FILENAME


@pytest.fixture
def model():
    return make_model("llama")


@pytest.fixture
def artifact(model):
    return patchkv.calibrate(model, calibration_ids(), mode="post_rope", energy=0.8, progress=False,
                             source="unit-test ids")


def assert_refused(model, artifact_or_path, error, *fragments):
    x = calibration_ids(1, 10, seed=2)
    before = model(x).logits
    with pytest.raises(error) as info:
        art = patchkv.Artifact.load(artifact_or_path) if not isinstance(artifact_or_path, patchkv.Artifact) \
            else artifact_or_path
        patchkv.apply(model, art)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not patchkv.is_patched(model)
    assert torch.equal(model(x).logits, before)


def test_round_trip(tmp_path, model, artifact):
    file = artifact.save(tmp_path / "bases")
    assert file == tmp_path / "bases" / FILENAME
    loaded = patchkv.Artifact.load(tmp_path / "bases")
    assert loaded.mode == "post_rope" and loaded.model == artifact.model
    assert loaded.calibration["source"] == "unit-test ids" and loaded.calibration["tokens"] == 8 * 48
    assert loaded.metadata()["checksum"] == artifact.metadata()["checksum"]
    for name, tensor in artifact.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor)
    x = calibration_ids(2, 12, seed=3)
    with patchkv.patched(model, artifact):  # in chunks: later forwards read the latents
        a = fed_in_chunks(model, x, 3)
    with patchkv.patched(model, loaded):
        b = fed_in_chunks(model, x, 3)
    assert torch.equal(a, b) and not torch.allclose(a, model(x).logits, atol=1e-3)
    assert kv_bytes_per_token(patchkv.Artifact.load(file)) == kv_bytes_per_token(artifact)


def test_saved_files_are_reproducible(tmp_path, artifact):
    first, second = artifact.save(tmp_path / "a.safetensors"), artifact.save(tmp_path / "b.safetensors")
    assert first.read_bytes() == second.read_bytes()


def test_sizes_and_ratio(artifact):
    layers, heads, dim = 2, 2, 16
    assert full_kv_bytes_per_token(artifact) == 2 * layers * heads * dim * 4
    kept = int(artifact.keys.ranks.sum() + artifact.values.ranks.sum())
    assert kv_bytes_per_token(artifact) == kept * 4
    assert compression_ratio(artifact) == pytest.approx(2 * layers * heads * dim / kept)
    assert compression_ratio(artifact.with_ranks(rank=4)) == pytest.approx(4.0)


@pytest.mark.parametrize("overrides, field", [
    ({"num_hidden_layers": 3}, "num_hidden_layers"),
    ({"head_dim": 32}, "head_dim"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
])
def test_artifact_for_another_model_is_refused(artifact, overrides, field):
    other = make_model("llama", **overrides)
    assert_refused(other, artifact, patchkv.IncompatibleArtifactError, field, "patchkv.calibrate")


def test_other_family_is_refused(artifact):
    assert_refused(make_model("qwen2"), artifact, patchkv.IncompatibleArtifactError, "model_type")


def test_an_artifact_applies_to_the_model_in_any_floating_dtype(artifact):
    """The artifact records the calibration dtype as information; bases are cast once, at apply."""
    assert artifact.model["dtype"] == "float32"
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        model = make_model("llama", dtype=dtype)
        with patchkv.patched(model, artifact):
            lp = model.model.layers[0].self_attn.patchkv
            assert lp.keys.basis.basis.dtype == dtype
            assert torch.isfinite(model(calibration_ids(1, 12)).logits).all()


def test_corrupted_file_is_refused(tmp_path, model, artifact):
    file = artifact.save(tmp_path / "a.safetensors")
    data = bytearray(file.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside tensor data: still a valid safetensors file
    file.write_bytes(bytes(data))
    assert_refused(model, file, patchkv.ArtifactError, "checksum", "corrupted")


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_file_is_refused(tmp_path, model, artifact, keep):
    file = artifact.save(tmp_path / "a.safetensors")
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    assert_refused(model, file, patchkv.ArtifactError, "truncated or corrupted")


def rewrite_metadata(file, edit):
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    meta = json.loads(header["__metadata__"]["patchkv"])
    tensors = load_file(str(file))
    edit(meta, tensors)
    save_file(tensors, str(file), metadata={"patchkv": json.dumps(meta)})


def test_unknown_format_version_is_refused(tmp_path, model, artifact):
    file = artifact.save(tmp_path / "a.safetensors")
    rewrite_metadata(file, lambda meta, t: meta.update(format_version=99))
    assert_refused(model, file, patchkv.ArtifactError, "version 99", "reads versions 1, 2")


def test_rank_above_head_dim_is_refused(tmp_path, model, artifact):
    with pytest.raises(ValueError, match="head_dim=16"):
        patchkv.calibrate(model, calibration_ids(), rank=17, progress=False)
    file = artifact.save(tmp_path / "a.safetensors")

    def inflate(meta, tensors):  # a hand-edited file whose checksum is even made consistent
        tensors["keys.ranks"][0, 0] = 17
        meta.pop("checksum")
        from patchkv.artifact_format import checksum
        meta["checksum"] = checksum(tensors, meta)

    rewrite_metadata(file, inflate)
    assert_refused(model, file, patchkv.ArtifactError, "head_dim=16", "[17]")


def test_not_an_artifact(tmp_path, model):
    file = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(file))
    assert_refused(model, file, patchkv.ArtifactError, "not a patchkv artifact")
    assert_refused(model, tmp_path / "missing", patchkv.ArtifactError, "No artifact at")


def test_unsupported_architecture_names_supported_ones(artifact):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    for call in (lambda: patchkv.apply(gpt2, artifact), lambda: patchkv.calibrate(gpt2, calibration_ids())):
        with pytest.raises(patchkv.UnsupportedModelError) as info:
            call()
        assert all(name in str(info.value) for name in ("gpt2", "llama", "mistral", "qwen2", "qwen3"))
    assert not patchkv.is_patched(gpt2)


def test_double_apply_is_refused(model, artifact):
    patchkv.apply(model, artifact)
    with pytest.raises(patchkv.AlreadyPatchedError, match="patchkv.remove"):
        patchkv.apply(model, artifact)


SHIPPED = sorted((Path(__file__).resolve().parents[1] / "artifacts").glob("*-bases/*.safetensors"))


@pytest.mark.parametrize("file", SHIPPED, ids=lambda f: f"{f.parent.name}/{f.stem}")
def test_shipped_bases_load_bit_identical_and_round_trip(tmp_path, file):
    """The bases in the repo, of format versions 1 to 3, load unchanged (a version 3 file's step scales as one
    typed budget) and, saved again at the current version, load back to the same tensors and budgets."""
    stored = load_file(str(file))
    art = patchkv.Artifact.load(file)
    for name, tensor in art.tensors().items():
        raw = stored[name]
        assert torch.equal(tensor[0] if name.endswith(".step_scales") and raw.dim() == 2 else tensor, raw), name
    assert art.has_step_scales == ("keys.step_scales" in stored)
    back = patchkv.Artifact.load(art.save(tmp_path / "again.safetensors"))
    assert back.step_budgets == art.step_budgets and back.format_version == art.format_version
    assert all(torch.equal(t, art.tensors()[n]) for n, t in back.tensors().items())
