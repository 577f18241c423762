"""Push to and download from the Hub, against a loopback server (the real Hub is unreachable here)."""

import hashlib

import torch
from conftest import calibration_ids, make_model
from fake_hub import FakeHub

import patchkv
from patchkv.artifact import FILENAME


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
        for fragment in ("library_name: patchkv", "`pre_rope`", f"{artifact.compression_ratio():.2f}x",
                         "pre_rope | 10.5 (+0.5)", artifact.metadata()["checksum"]):
            assert fragment in card
        downloaded = patchkv.Artifact.from_pretrained("me/bases", endpoint=hub.url, token="hf_test")
    assert downloaded.metadata()["checksum"] == artifact.metadata()["checksum"]
    assert any(c.startswith("POST /api/models/me/bases/commit/main") for c in hub.calls)
    x = calibration_ids(1, 16, seed=1)
    with patchkv.patched(model, downloaded):
        a = model(x).logits
    with patchkv.patched(model, artifact):
        assert torch.equal(a, model(x).logits)


def test_from_pretrained_reads_local_paths(tmp_path):
    artifact = patchkv.calibrate(make_model("qwen2"), calibration_ids(), rank=3, progress=False)
    artifact.save(tmp_path / "dir")
    artifact.save(tmp_path / "file.safetensors")
    for path in (tmp_path / "dir", tmp_path / "file.safetensors", str(tmp_path / "dir")):
        assert patchkv.Artifact.from_pretrained(path).metadata() == artifact.metadata()
