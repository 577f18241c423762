"""Push to and download from the Hub, against a loopback server (the real Hub is unreachable here)."""

import hashlib
import time

import pytest
import torch
import yaml
from conftest import calibration_ids, fed_in_chunks, make_model
from fake_hub import FakeHub, front_matter

import patchkv
from patchkv.allocation import compression_ratio
from patchkv.artifact import FILENAME, file_sha256
from patchkv.errors import ArtifactError, HubError


def test_push_to_hub_uploads_artifact_and_model_card(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = make_model("mistral")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", energy=0.8, progress=False)
    local = artifact.save(tmp_path / "local.safetensors")
    table = "| config | ppl |\n|---|---|\n| unpatched | 10.0 |\n| pre_rope | 10.5 (+0.5) |"
    with FakeHub() as hub:
        url = artifact.push_to_hub("me/bases", token="hf_test", private=True, endpoint=hub.url, eval_table=table)
        repo = hub.repos["me/bases"]
        assert repo["private"] and "/me/bases/commit/" in url
        assert set(repo["files"]) == {FILENAME, "README.md"}
        # the bytes that arrived are the artifact, byte for byte, and load with a valid checksum
        assert hashlib.sha256(repo["files"][FILENAME]).digest() == hashlib.sha256(local.read_bytes()).digest()
        card = repo["files"]["README.md"].decode()
        for fragment in ("library_name: patchkv", "`pre_rope`", f"{compression_ratio(artifact):.2f}x",
                         "pre_rope | 10.5 (+0.5)", artifact.metadata()["checksum"]):
            assert fragment in card
        downloaded = patchkv.Artifact.from_pretrained("me/bases", endpoint=hub.url, token="hf_test",
                                                      cache_dir=tmp_path / "c")  # not the user's Hub cache
    assert downloaded.metadata()["checksum"] == artifact.metadata()["checksum"]
    assert any(c.startswith("POST /api/models/me/bases/commit/main") for c in hub.calls)
    x = calibration_ids(1, 16, seed=1)
    with patchkv.patched(model, downloaded):  # in chunks: later forwards read the latents
        a = fed_in_chunks(model, x, 4)
    with patchkv.patched(model, artifact):
        assert torch.equal(a, fed_in_chunks(model, x, 4))
    assert not torch.allclose(a, model(x).logits, atol=1e-3)  # the latents were read


def test_from_pretrained_reads_local_paths(tmp_path):
    artifact = patchkv.calibrate(make_model("qwen2"), calibration_ids(), rank=3, progress=False)
    artifact.save(tmp_path / "dir")
    artifact.save(tmp_path / "file.safetensors")
    for path in (tmp_path / "dir", tmp_path / "file.safetensors", str(tmp_path / "dir")):
        assert patchkv.Artifact.from_pretrained(path).metadata() == artifact.metadata()


# ----- reliability: corrupted caches, revisions, model cards, local paths shadowing repo ids -----------------


@pytest.fixture
def small_artifact():
    return patchkv.calibrate(make_model("llama"), calibration_ids(), rank=4, progress=False)


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    with FakeHub() as h:
        yield h


def _gets(hub):
    return [c for c in hub.calls if c.startswith("GET ") and FILENAME in c]


def test_corrupted_cache_is_redownloaded_once(tmp_path, hub, small_artifact):
    small_artifact.push_to_hub("me/bases", token="hf_test", endpoint=hub.url)
    cache = tmp_path / "cache"
    kw = dict(endpoint=hub.url, token="hf_test", cache_dir=cache)
    assert patchkv.Artifact.from_pretrained("me/bases", **kw).metadata() == small_artifact.metadata()
    assert len(_gets(hub)) == 1
    (blob,) = (cache / "models--me--bases" / "blobs").iterdir()
    data = bytearray(blob.read_bytes())
    data[-10] ^= 0xFF  # the cached copy rots: a valid safetensors file with a bad checksum
    blob.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        patchkv.Artifact.load(blob)
    again = patchkv.Artifact.from_pretrained("me/bases", **kw)  # re-downloaded, not failing forever
    assert again.metadata() == small_artifact.metadata() and len(_gets(hub)) == 2
    assert patchkv.Artifact.load(blob).metadata() == small_artifact.metadata()  # the cache is healed
    patchkv.Artifact.from_pretrained("me/bases", force_download=True, **kw)
    assert len(_gets(hub)) == 3


def test_bad_copy_on_the_hub_fails_after_one_retry(tmp_path, hub, small_artifact):
    small_artifact.push_to_hub("me/bases", token="hf_test", endpoint=hub.url)
    data = bytearray(hub.repos["me/bases"]["files"][FILENAME])
    data[-10] ^= 0xFF
    hub.repos["me/bases"]["files"][FILENAME] = bytes(data)
    with pytest.raises(ArtifactError, match="even after a fresh re-download") as info:
        patchkv.Artifact.from_pretrained("me/bases", endpoint=hub.url, cache_dir=tmp_path / "c")
    assert "checksum" in str(info.value) and len(_gets(hub)) == 2


def test_expected_sha256_from_the_hub(tmp_path, hub, small_artifact):
    small_artifact.push_to_hub("me/bases", token="hf_test", endpoint=hub.url)
    local = small_artifact.save(tmp_path / "a.safetensors")
    digest = file_sha256(local)
    kw = dict(endpoint=hub.url, cache_dir=tmp_path / "c")
    for form in (digest, digest.removeprefix("sha256:"), digest.upper().replace("SHA256:", "sha256:")):
        patchkv.Artifact.from_pretrained("me/bases", sha256=form, **kw)
    with pytest.raises(ArtifactError, match="expected sha256:0000"):
        patchkv.Artifact.from_pretrained("me/bases", sha256="0" * 64, **kw)


@pytest.mark.parametrize("revision", ["main\n", "a b", "../main", "main..x", "", 5, "x:y", "/main", "v1.lock"])
def test_invalid_revision_is_refused_before_any_request(hub, revision):
    with pytest.raises(ArtifactError, match="revision"):
        patchkv.Artifact.from_pretrained("me/bases", revision=revision, endpoint=hub.url)
    assert hub.calls == []


def test_valid_revisions_reach_the_hub(tmp_path, hub, small_artifact):
    small_artifact.push_to_hub("me/bases", token="hf_test", endpoint=hub.url)
    for revision in ("main", "v1.0", "a" * 40):
        patchkv.Artifact.from_pretrained("me/bases", revision=revision, endpoint=hub.url,
                                         cache_dir=tmp_path / revision)


def test_missing_repo_is_a_hub_error(tmp_path, hub):
    with pytest.raises(HubError, match="me/missing"):
        patchkv.Artifact.from_pretrained("me/missing", endpoint=hub.url, cache_dir=tmp_path / "c")


@pytest.mark.parametrize("name", ["foo: bar", "x\nevil: true", "a\n---\nb: 1", "'quoted\" [list] {map} # c"])
def test_model_card_front_matter_survives_any_model_name(hub, small_artifact, name):
    small_artifact.model["name_or_path"] = name
    small_artifact.push_to_hub("me/card", token="hf_test", endpoint=hub.url)
    card = hub.repos["me/card"]["files"]["README.md"].decode()
    front = yaml.safe_load(front_matter(card))
    assert front == {"library_name": "patchkv", "tags": ["kv-cache", "pca", "patchkv"], "base_model": name}
    assert card.split("\n---\n", 1)[1].count("\n---\n") == 0  # no second front-matter block in the body


@pytest.mark.parametrize("name", ["./nope", "../nope", "/nope/x", "~/nope-patchkv", "nope.safetensors",
                                  "dir/nope.safetensors"])
def test_path_like_strings_are_not_sent_to_the_hub(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(ArtifactError, match="not looked up on the Hub"):
        patchkv.Artifact.from_pretrained(name, endpoint="http://127.0.0.1:9")  # nothing listens there
    assert time.monotonic() - start < 2


def test_local_folder_shadowing_a_repo_id_is_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "me" / "bases").mkdir(parents=True)  # an unrelated folder named like the repo id
    with pytest.raises(ArtifactError) as info:
        patchkv.Artifact.from_pretrained("me/bases", endpoint="http://127.0.0.1:9")
    assert "treated as a local path" in str(info.value) and "Hub repo of the same name" in str(info.value)
    (tmp_path / "junk.bin").write_bytes(b"not an artifact")
    with pytest.raises(ArtifactError, match="treated as a local path"):
        patchkv.Artifact.from_pretrained("junk.bin")
