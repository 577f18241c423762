"""Share artifacts on the Hugging Face Hub: a repo holding `patchkv.safetensors` and a model card."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .artifact import FILENAME, Artifact


def model_card(artifact: Artifact, eval_table: str | None = None) -> str:
    """A README.md recording the model, mode, ranks, sizes, calibration and (if given) measured eval deltas."""
    m, cal = artifact.model, artifact.calibration
    key_ranks = [round(float(r), 1) for r in artifact.keys.ranks.float().mean(1)]
    value_ranks = [round(float(r), 1) for r in artifact.values.ranks.float().mean(1)]
    lines = [
        "---", "library_name: patchkv", "tags:", "- kv-cache", "- pca", "- patchkv",
        *([f"base_model: {m['name_or_path']}"] if m.get("name_or_path") else []), "---", "",
        f"# patchkv bases for {m.get('name_or_path') or m['model_type']}", "",
        "Calibrated PCA bases that store this model's KV cache as low-rank latents "
        "([patchkv](https://pypi.org/project/patchkv/)).", "",
        "| field | value |", "|---|---|",
        f"| model | `{m.get('name_or_path') or '-'}` ({m['architecture']}, {m['model_type']}, {m['dtype']}) |",
        f"| mode | `{artifact.mode}` |",
        f"| layers x KV heads x head_dim | {artifact.num_layers} x {artifact.num_kv_heads} x {artifact.head_dim} |",
        f"| mean key rank per layer | {key_ranks} |",
        f"| mean value rank per layer | {value_ranks} |",
        f"| KV bytes per token | {artifact.kv_bytes_per_token()} (uncompressed {artifact.full_kv_bytes_per_token()}) |",
        f"| compression | {artifact.compression_ratio():.2f}x |",
        f"| calibration | {cal.get('source', '-')}: {cal.get('tokens', '-')} tokens, sink_tokens="
        f"{cal.get('sink_tokens', 0)}, selection {cal.get('rank_selection', {})} |",
        f"| checksum | `{artifact.metadata()['checksum']}` |", "",
    ]
    if eval_table:
        lines += ["## Measured evaluation (vs the unpatched model)", "", eval_table.strip(), ""]
    lines += ["## Use", "", "```python", "import patchkv",
              f"artifact = patchkv.Artifact.from_pretrained(\"<this repo>\")",
              "model = patchkv.apply(model, artifact)", "```", ""]
    return "\n".join(lines)


def push_to_hub(artifact: Artifact, repo_id: str, token: str | None = None, private: bool = True, *,
                eval_table: str | None = None, endpoint: str | None = None,
                commit_message: str = "Upload patchkv artifact") -> str:
    """Create (or reuse) `repo_id` and upload the artifact with its model card. Returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory() as tmp:
        artifact.save(Path(tmp) / FILENAME)
        (Path(tmp) / "README.md").write_text(model_card(artifact, eval_table), encoding="utf-8")
        info = api.upload_folder(repo_id=repo_id, folder_path=tmp, repo_type="model", commit_message=commit_message)
    return str(info.commit_url if hasattr(info, "commit_url") else info)


def from_pretrained(repo_id_or_path: str | Path, *, revision: str | None = None, token: str | None = None,
                    endpoint: str | None = None) -> Artifact:
    """Load from a local file or directory if one exists at `repo_id_or_path`, else download from the Hub."""
    path = Path(repo_id_or_path)
    if path.exists():
        return Artifact.load(path)
    from huggingface_hub import hf_hub_download

    file = hf_hub_download(str(repo_id_or_path), FILENAME, revision=revision, token=token, endpoint=endpoint)
    return Artifact.load(file)
