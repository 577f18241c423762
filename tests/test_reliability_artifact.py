"""Hostile or careless artifacts: bad contents and bad metadata types are refused at load and at construction,
with an `ArtifactError` naming the tensor, layer and head, and the model is left untouched."""

import copy
import errno
import hashlib
import io
import json
import os
import time
import types

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model
from safetensors.torch import load_file, save_file

import patchkv
from patchkv.artifact import Artifact, Components
from patchkv.artifact_format import checksum, file_sha256
from patchkv.errors import ArtifactError, InvalidArtifactError


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def base(model):
    return patchkv.calibrate(model, calibration_ids(), mode="pre_rope", energy=0.8, progress=False)


@pytest.fixture
def artifact(base):
    return copy.deepcopy(base)


def read(file):
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return load_file(str(file)), json.loads(f.metadata()["patchkv"])


def write(file, tensors, meta, *, fix_checksum=True):
    """Write tensors and metadata; by default with a checksum made consistent (a deliberate, hand-made file)."""
    if fix_checksum and isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k != "checksum"}
        meta["checksum"] = checksum(tensors, meta)
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file(tensors, str(file), metadata={"patchkv": text})
    return file


def edited_refusal(tmp_path, artifact, edit) -> str:
    """The message `Artifact.load` refuses `artifact` with once saved and its tensors and metadata passed through
    `edit(tensors, meta)` (the checksum made consistent)."""
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    edit(tensors, meta)
    with pytest.raises(ArtifactError) as info:
        Artifact.load(write(tmp_path / "b.safetensors", tensors, meta))
    return str(info.value)


def assert_load_refused(model, file, *fragments, sha256=None):
    x = calibration_ids(1, 10, seed=2)
    before = model(x).logits
    with pytest.raises(ArtifactError) as info:
        patchkv.apply(model, Artifact.load(file, sha256=sha256))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert not patchkv.is_patched(model)
    assert torch.equal(model(x).logits, before)
    return info.value


def _nan(t, l, h):
    t[l, h, 3] = float("nan")


def _inf(t, l, h):
    t[l, h, 0] = float("inf")


def _skew(t, l, h):  # a column 1.1 times too long: no longer orthonormal
    t[l, h, :, 2] *= 1.1


def _mix(t, l, h):  # two columns that are no longer orthogonal
    t[l, h, :, 1] = (t[l, h, :, 1] + t[l, h, :, 0]) / 2 ** 0.5 + 0.1


def _negative(t, l, h):
    t[l, h, -1] = -0.5 * float(t[l, h].max())


def _unsorted(t, l, h):
    t[l, h, 0], t[l, h, 1] = float(t[l, h, 1]), float(t[l, h, 0]) + 1.0


def _zero(t, l, h):
    t[l, h] = 0


CONTENT_DEFECTS = [
    ("keys.mean", _nan, "NaN or Inf"),
    ("values.mean", _inf, "NaN or Inf"),
    ("keys.eigenvalues", _nan, "NaN or Inf"),
    ("values.eigenvalues", _inf, "NaN or Inf"),
    ("keys.eigenvectors", _nan, "NaN or Inf"),
    ("values.eigenvectors", _skew, "not orthonormal"),
    ("keys.eigenvectors", _mix, "not orthonormal"),
    ("keys.eigenvalues", _negative, ">= 0"),
    ("values.eigenvalues", _unsorted, "descending"),
    ("keys.ranks", _zero, "[1, head_dim=16]"),
]


@pytest.mark.parametrize("name, defect, fragment", CONTENT_DEFECTS, ids=[f"{n}-{d.__name__}" for n, d, _ in
                                                                         CONTENT_DEFECTS])
def test_bad_contents_with_a_valid_checksum_are_refused_at_load(tmp_path, model, artifact, name, defect, fragment):
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    defect(tensors[name], 1, 1)
    file = write(tmp_path / "a.safetensors", tensors, meta)
    assert_load_refused(model, file, str(file), name, "layer 1, head 1", fragment)


@pytest.mark.parametrize("name, defect, fragment", CONTENT_DEFECTS, ids=[f"{n}-{d.__name__}" for n, d, _ in
                                                                         CONTENT_DEFECTS])
def test_bad_contents_are_refused_at_construction(artifact, name, defect, fragment):
    kind, field = name.split(".")
    parts = {k: Components(*(getattr(getattr(artifact, k), f).clone() for f in
                             ("mean", "eigenvalues", "eigenvectors", "ranks"))) for k in ("keys", "values")}
    defect(getattr(parts[kind], field), 1, 1)
    with pytest.raises(InvalidArtifactError) as info:
        Artifact(mode=artifact.mode, model=artifact.model, calibration=artifact.calibration, **parts)
    assert isinstance(info.value, ArtifactError) and isinstance(info.value, ValueError)
    assert name in str(info.value) and "layer 1, head 1" in str(info.value) and fragment in str(info.value)


def test_ranks_of_zero_fail_before_they_reach_a_file(tmp_path, artifact):
    artifact.keys.ranks = artifact.keys.ranks.clone()
    artifact.keys.ranks[0, 1] = 0  # changed after construction
    with pytest.raises(ArtifactError, match=r"keys.ranks at layer 0, head 1.*\[0\]"):
        artifact.save(tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()
    with pytest.raises(ValueError, match="rank"):
        artifact.with_ranks(rank=0)
    ranks = torch.ones_like(artifact.keys.ranks)
    ranks[1, 0] = -3
    with pytest.raises(ArtifactError, match=r"layer 1, head 0.*\[-3\]"):
        Artifact(mode="pre_rope", model=artifact.model,
                 keys=Components(artifact.keys.mean, artifact.keys.eigenvalues, artifact.keys.eigenvectors, ranks),
                 values=artifact.values)


def test_round_off_negative_eigenvalues_are_clamped(tmp_path, model, artifact):
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    tensors["keys.eigenvalues"][1, 0, -1] = -1e-8 * float(tensors["keys.eigenvalues"][1, 0, 0])
    loaded = Artifact.load(write(tmp_path / "a.safetensors", tensors, meta))
    assert float(loaded.keys.eigenvalues.min()) == 0.0
    with patchkv.patched(model, loaded):  # in chunks: later forwards read the latents
        assert torch.isfinite(fed_in_chunks(model, calibration_ids(1, 10), 2)).all()


@pytest.mark.parametrize("edit, fragment", [
    (lambda t: t.update({"keys.mean": t["keys.mean"].double()}), "keys.mean is stored as float64"),
    (lambda t: t.update({"values.ranks": t["values.ranks"].long()}), "values.ranks is stored as int64"),
    (lambda t: t.update({"keys.eigenvalues": t["keys.eigenvalues"].half()}), "stored as float16"),
    (lambda t: t.pop("values.eigenvectors"), "missing ['values.eigenvectors']"),
    (lambda t: t.update({"extra": torch.zeros(1)}), "unexpected ['extra']"),
])
def test_tensor_set_and_dtypes_are_as_the_spec_says(tmp_path, model, artifact, edit, fragment):
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    edit(tensors)
    assert_load_refused(model, write(tmp_path / "a.safetensors", tensors, meta), fragment)


def test_in_memory_int64_ranks_and_float64_bases_are_accepted(artifact):
    assert artifact.keys.ranks.dtype == torch.int64 and artifact.keys.eigenvectors.dtype == torch.float64
    Artifact(mode=artifact.mode, model=artifact.model, keys=artifact.keys, values=artifact.values)
    bad = Components(artifact.keys.mean, artifact.keys.eigenvalues, artifact.keys.eigenvectors,
                     artifact.keys.ranks.float())
    with pytest.raises(ArtifactError, match="keys.ranks has dtype float32"):
        Artifact(mode=artifact.mode, model=artifact.model, keys=bad, values=artifact.values)


def _with(**fields):
    return lambda meta: meta.update(fields)


def _model_with(**fields):
    return lambda meta: meta["model"].update(fields)


def _without(field, sub=None):
    return lambda meta: (meta[sub] if sub else meta).pop(field)


@pytest.mark.parametrize("edit, fragment", [
    (_with(model=5), "'model' must be a JSON object, found a JSON number"),
    (_with(model=[1, 2]), "'model' must be a JSON object, found a JSON array"),
    (_with(mode=5), "mode must be one of"),
    (_with(mode="sideways"), "mode must be one of"),
    (_with(calibration=[1]), "'calibration' must be a JSON object"),
    (_with(calibration="x"), "'calibration' must be a JSON object"),
    (_with(format_version=True), "format version True"),
    (_with(format_version="1"), "format version '1'"),
    (_with(extra=1), "unexpected ['extra']"),
    (_without("model"), "missing ['model']"),
    (_without("mode"), "missing ['mode']"),
    (_without("calibration"), "missing ['calibration']"),
    (_without("format_version"), "missing ['format_version']"),
    (_without("head_dim", "model"), "missing the field(s) ['head_dim']"),
    (_without("dtype", "model"), "missing the field(s) ['dtype']"),
    (_model_with(num_hidden_layers="2"), "model.num_hidden_layers must be a positive integer"),
    (_model_with(head_dim=True), "model.head_dim must be a positive integer"),
    (_model_with(head_dim=32), "head_dim=32 (tensors have 16)"),
    (_model_with(num_key_value_heads=0), "model.num_key_value_heads must be a positive integer"),
    (_model_with(model_type=None), "model.model_type must be a string"),
    (_model_with(name_or_path={"a": 1}), "model.name_or_path must be a string"),
    (_model_with(dtype="int8"), "model.dtype must be one of"),
    (_model_with(dtype=["float32"]), "model.dtype must be one of"),
    (_model_with(quantization="int4"), "model has the unexpected field(s) ['quantization']"),
])
def test_metadata_of_the_wrong_types_is_refused(tmp_path, model, artifact, edit, fragment):
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    edit(meta)
    err = assert_load_refused(model, write(tmp_path / "a.safetensors", tensors, meta), fragment)
    assert isinstance(err, ArtifactError)


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2, 3]", "must be a JSON object, found a JSON array"),
    ('"just a string"', "found a JSON string"),
    ("null", "found a JSON null"),
    ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ("{not json", "not valid JSON"),
])
def test_metadata_that_is_not_an_object_is_refused(tmp_path, model, artifact, text, fragment):
    tensors, _ = read(artifact.save(tmp_path / "a.safetensors"))
    assert_load_refused(model, write(tmp_path / "a.safetensors", tensors, text), fragment)


def test_checksum_field_of_the_wrong_type(tmp_path, model, artifact):
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    meta["checksum"] = 5
    assert_load_refused(model, write(tmp_path / "a.safetensors", tensors, meta, fix_checksum=False),
                        "checksum must be a string")


def test_construction_refuses_wrong_metadata_types(artifact):
    kw = dict(keys=artifact.keys, values=artifact.values)
    for bad, fragment in [(dict(mode=5, model=artifact.model), "mode must be one of"),
                          (dict(mode="pre_rope", model=5), "model must be a dict"),
                          (dict(mode="pre_rope", model=artifact.model, calibration=[1]), "calibration must be"),
                          (dict(mode="pre_rope", model=artifact.model, calibration={"x": object()}),
                           "JSON-serialisable"),
                          (dict(mode="pre_rope", model={**artifact.model, "dtype": "foo"}), "model.dtype"),
                          (dict(mode="pre_rope", model={**artifact.model, "extra": 1}),
                           r"unexpected field\(s\) \['extra'\]")]:
        with pytest.raises(ArtifactError, match=fragment):
            Artifact(**bad, **kw)
    with pytest.raises(ArtifactError, match="to_dtype"):
        artifact.to_dtype("foo")


def test_expected_sha256_at_load(tmp_path, model, artifact):
    import hashlib

    file = artifact.save(tmp_path / "a.safetensors")
    hexdigest = hashlib.sha256(file.read_bytes()).hexdigest()  # what `sha256sum a.safetensors` prints
    assert file_sha256(file) == "sha256:" + hexdigest
    for form in (hexdigest, "sha256:" + hexdigest, hexdigest.upper(), f"  {hexdigest}\n"):
        assert Artifact.load(file, sha256=form).metadata() == artifact.metadata()
    assert Artifact.from_pretrained(tmp_path / "a.safetensors", sha256=hexdigest).mode == "pre_rope"
    assert_load_refused(model, file, "expected sha256:" + "0" * 64, sha256="0" * 64)
    for bad in ("abc", "md5:" + hexdigest, 5, hexdigest + "0"):
        with pytest.raises(ValueError, match="64 hex digits"):
            Artifact.load(file, sha256=bad)


def test_validation_is_fast_at_smollm2_size():
    """30 layers x 3 KV heads x 64: the checks are vectorised, well under a second."""
    layers, heads, dim = 30, 3, 64
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(layers, heads, dim, dim, dtype=torch.float64, generator=g))
    ev = torch.rand(layers, heads, dim, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    parts = {k: Components(torch.zeros(layers, heads, dim), ev.float(), q.float(),
                           torch.full((layers, heads), 16, dtype=torch.int32)) for k in ("keys", "values")}
    model = {"model_type": "llama", "architecture": "LlamaForCausalLM", "name_or_path": "smollm2-shaped",
             "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": heads,
             "head_dim": dim, "hidden_size": 576, "dtype": "float32"}
    Artifact(mode="pre_rope", model=model, **parts)  # warm-up
    start = time.perf_counter()
    Artifact(mode="pre_rope", model=model, **parts)
    assert time.perf_counter() - start < 1.0


def test_a_pinned_load_parses_the_bytes_it_hashed(tmp_path, monkeypatch, artifact):
    """The file is swapped for another artifact (os.replace) right after its hash is taken: the load returns the
    artifact whose bytes were hashed, never the other one."""
    pinned = artifact.save(tmp_path / "a.safetensors")
    digest = file_sha256(pinned)
    other = artifact.with_ranks(rank=2).save(tmp_path / "b.safetensors")
    swapped = []

    class SwapAfterHashing:
        def __init__(self, *data):
            self.h = hashlib.sha256(*data)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            if not swapped:
                os.replace(other, pinned)
                swapped.append(True)
            return self.h.hexdigest()

    monkeypatch.setattr(patchkv.artifact, "hashlib", types.SimpleNamespace(sha256=SwapAfterHashing))
    loaded = Artifact.load(pinned, sha256=digest)
    monkeypatch.undo()
    assert swapped and file_sha256(pinned) != digest  # the path now holds the other artifact
    assert loaded.metadata() == artifact.metadata()
    assert torch.equal(loaded.keys.ranks.long(), artifact.keys.ranks.long())


def test_load_reads_the_file_once(tmp_path, monkeypatch, artifact):
    file = artifact.save(tmp_path / "a.safetensors")
    reads = []
    real = type(file).read_bytes

    def counted(self):
        reads.append(self)
        return real(self)

    monkeypatch.setattr(type(file), "read_bytes", counted)
    for sha256 in (None, file_sha256(file)):
        reads.clear()
        assert Artifact.load(file, sha256=sha256).metadata() == artifact.metadata()
        assert reads == [file]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_saved_files_have_the_umask_mode(tmp_path, artifact, umask):
    previous = os.umask(umask)
    try:
        file = artifact.save(tmp_path / "a.safetensors")
        assert os.stat(file).st_mode & 0o777 == 0o666 & ~umask
        os.chmod(file, 0o600)
        artifact.save(file)  # replacing a file gives the new file the umask's mode too
        assert os.stat(file).st_mode & 0o777 == 0o666 & ~umask
    finally:
        os.umask(previous)
    assert os.listdir(tmp_path) == ["a.safetensors"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_save_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch, artifact, failure):
    file = artifact.save(tmp_path / "a.safetensors")
    before = file.read_bytes()

    def fail(fd):
        raise failure

    monkeypatch.setattr(patchkv.artifact.os, "fsync", fail)
    with pytest.raises(type(failure)) as info:
        artifact.with_ranks(rank=2).save(file)
    monkeypatch.undo()
    if isinstance(failure, OSError):
        assert info.value.errno == errno.ENOSPC and str(file) in str(info.value)
    assert file.read_bytes() == before and os.listdir(tmp_path) == ["a.safetensors"]
    assert Artifact.load(file).metadata() == artifact.metadata()


def test_saved_bytes_are_what_safetensors_writes(tmp_path, artifact):
    file = artifact.save(tmp_path / "a.safetensors")
    save_file(artifact.tensors(), str(tmp_path / "ref.safetensors"),
              metadata={"patchkv": json.dumps(artifact.metadata())})
    assert file.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_empty_and_unexpandable_paths_are_refused(tmp_path, monkeypatch, artifact):
    monkeypatch.chdir(tmp_path)
    artifact.save(".")  # ./patchkv.safetensors: what an empty string used to reach
    for call in (lambda: Artifact.load(""), lambda: Artifact.from_pretrained(""), lambda: artifact.save(""),
                 lambda: Artifact.load("", sha256="0" * 64)):
        with pytest.raises(ArtifactError, match="empty string"):
            call()
    for call in (lambda: Artifact.load("~patchkv-no-such-user/a"), lambda: artifact.save("~patchkv-no-such-user/a"),
                 lambda: Artifact.from_pretrained("~patchkv-no-such-user/a")):
        with pytest.raises(ArtifactError, match="~patchkv-no-such-user"):
            call()


def _nested(depth: int) -> dict:
    """A calibration summary whose objects and arrays nest `depth` deep, itself included."""
    inner = [1]
    for _ in range(depth - 2):
        inner = [inner]
    return {"fits": inner}


def test_calibration_nested_too_deep_or_too_large_is_refused(tmp_path, model, artifact):
    """Free-form calibration nested 600-900 deep used to load and then raise RecursionError in `with_ranks`,
    `to_dtype`, `apply` and pickling: more than 32 deep, or over 1,000,000 characters of JSON, is refused at load and
    at construction; 32 deep loads, copies, applies and pickles."""
    tensors, meta = read(artifact.save(tmp_path / "a.safetensors"))
    for depth in (33, 600, 900):
        meta["calibration"] = _nested(depth)
        assert_load_refused(model, write(tmp_path / "deep.safetensors", tensors, meta), "deep.safetensors",
                            "calibration nests objects and arrays more than 32 deep")
    kw = dict(mode=artifact.mode, model=artifact.model, keys=artifact.keys, values=artifact.values)
    for calibration, fragment in [(_nested(5000), "more than 32 deep"),  # deeper than json.dumps can write
                                  ({"x": "a" * 1_000_000}, "1,000,009 characters of JSON, more than the 1,000,000 allowed")]:
        with pytest.raises(InvalidArtifactError, match=fragment):
            Artifact(calibration=calibration, **kw)
    meta["calibration"] = _nested(32)
    loaded = Artifact.load(write(tmp_path / "deep.safetensors", tensors, meta)).with_ranks(rank=4)
    patched = patchkv.apply(copy.deepcopy(model), loaded.to_dtype(torch.float32), [patchkv.LowRank()])
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    assert patchkv.is_patched(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
