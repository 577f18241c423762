"""Share artifacts on the Hugging Face Hub: a repo holding `patchkv.safetensors` and a model card.

`from_pretrained(x)` reads a local file or directory when `x` exists; when `x` looks like a path (starts with
`./`, `../`, `/`, `~`, or ends with `.safetensors`) but does not exist it fails at once, without asking the Hub;
otherwise `x` is a Hub repo id. An empty string, or a `~user` that cannot be expanded, is an `ArtifactError` (an
empty string is not taken as the current folder). A downloaded file that fails any check of `Artifact.load` (a corrupted cache, an
interrupted download) is downloaded again once, bypassing the cache; a second failure is an `ArtifactError`.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .allocation import compression_ratio, full_kv_bytes_per_token, kv_bytes_per_token
from .artifact_format import FILENAME
from .errors import ArtifactError, HubError

if TYPE_CHECKING:  # this module sits below patchkv.artifact, which calls it; it only reads artifacts' attributes
    from .artifact import Artifact

Loaded = TypeVar("Loaded")

_COMMIT = re.compile(r"[0-9a-f]{40}")
_BAD_REF_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def model_card(artifact: Artifact, eval_table: str | None = None) -> str:
    """A README.md recording the model, mode, ranks, sizes, calibration and (if given) measured eval deltas.

    The YAML front matter is written by `yaml.safe_dump`, so any model name is quoted as needed.
    """
    import yaml

    m, cal = artifact.model, artifact.calibration
    name = m.get("name_or_path") or ""
    front: dict[str, Any] = {"library_name": "patchkv", "tags": ["kv-cache", "pca", "patchkv"]}
    if name:
        front["base_model"] = name
    key_ranks = [round(float(r), 1) for r in artifact.keys.ranks.float().mean(1)]
    value_ranks = [round(float(r), 1) for r in artifact.values.ranks.float().mean(1)]
    selection = cal.get("rank_selection", {})
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip("\n"), "---", "",
        f"# patchkv bases for {_md(name or m['model_type'])}", "",
        "Calibrated PCA bases that store this model's KV cache as low-rank latents "
        "([patchkv](https://pypi.org/project/patchkv/)).", "",
        "| field | value |", "|---|---|",
        f"| model | `{_md(name or '-')}` ({_md(m['architecture'])}, {_md(m['model_type'])}, {m['dtype']}) |",
        f"| mode | `{artifact.mode}` |",
        f"| layers x KV heads x head_dim | {artifact.num_layers} x {artifact.num_kv_heads} x {artifact.head_dim} |",
        f"| mean key rank per layer | {key_ranks} |",
        f"| mean value rank per layer | {value_ranks} |",
        f"| KV bytes per token | {kv_bytes_per_token(artifact)} (uncompressed {full_kv_bytes_per_token(artifact)}) |",
        f"| compression | {compression_ratio(artifact):.2f}x |",
        f"| calibration | {_md(cal.get('source', '-'))}: {_md(cal.get('tokens', '-'))} tokens, sink_tokens="
        f"{_md(cal.get('sink_tokens', 0))}, selection {_md(selection)} |",
        f"| checksum | `{artifact.metadata()['checksum']}` |", "",
    ]
    if eval_table:
        lines += ["## Measured evaluation (vs the unpatched model)", "", eval_table.strip(), ""]
    lines += ["## Use", "", "```python", "import patchkv",
              "artifact = patchkv.Artifact.from_pretrained(\"<this repo>\")",
              "model = patchkv.apply(model, artifact)", "```", ""]
    return "\n".join(lines)


def _md(value: Any) -> str:
    """`value` as one line of a markdown table cell: no newlines, no cell separators, no backticks."""
    return " ".join(str(value).split()).replace("|", "\\|").replace("`", "'")


def push_to_hub(artifact: Artifact, repo_id: str, token: str | None = None, private: bool = True, *,
                eval_table: str | None = None, endpoint: str | None = None,
                commit_message: str = "Upload patchkv artifact") -> str:
    """Create (or reuse) `repo_id` and upload the artifact with its model card. Returns the commit URL.

    Raises `ArtifactError` for an invalid repo id and `HubError` when the Hub refuses or cannot be reached.
    """
    from huggingface_hub import HfApi

    _check_repo_id(repo_id)
    with tempfile.TemporaryDirectory() as tmp:
        artifact.save(Path(tmp) / FILENAME)
        (Path(tmp) / "README.md").write_text(model_card(artifact, eval_table), encoding="utf-8")
        try:
            api = HfApi(endpoint=endpoint, token=token)
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            info = api.upload_folder(repo_id=repo_id, folder_path=tmp, repo_type="model",
                                     commit_message=commit_message)
        except Exception as e:  # huggingface_hub raises HTTP, network and validation errors of many types
            raise HubError(f"Could not push to the Hub repo {repo_id!r}: {type(e).__name__}: {e}") from e
    return str(info.commit_url if hasattr(info, "commit_url") else info)


def looks_like_path(value: str | Path) -> bool:
    """True for a `Path`, or a string that can only mean a local path: it starts with `./`, `../`, `/`, `~`
    (or their Windows forms), is `.` or `..`, or ends with `.safetensors`."""
    if isinstance(value, Path):
        return True
    s = str(value)
    return (s in (".", "..") or s.startswith(("./", "../", "/", "~", ".\\", "..\\", "\\"))
            or bool(re.match(r"[A-Za-z]:[\\/]", s)) or s.endswith(".safetensors"))


def expand_user(path: str | Path, error: type[Exception] = ArtifactError) -> Path:
    """`Path(path)` with a leading `~` or `~user` expanded; `error` (not a `RuntimeError`) when it cannot be."""
    try:
        return Path(path).expanduser()
    except RuntimeError as e:  # "~name" of a user that does not exist, or no home directory
        raise error(f"{path}: cannot expand {str(path).split('/')[0]!r} to a home folder ({e}): no such user, "
                    "or no home directory is set.") from e


def check_revision(revision: str | None) -> str | None:
    """`revision` unchanged if it is None, a 40-hex commit, or a branch/tag name; else `ArtifactError`."""
    if revision is None:
        return None
    if not isinstance(revision, str):
        raise ArtifactError(f"revision must be a string (a branch, tag or 40-hex commit), got {revision!r:.80}.")
    if _COMMIT.fullmatch(revision):
        return revision
    problems = []
    if not revision or len(revision) > 255:
        problems.append("it must have 1 to 255 characters")
    if _BAD_REF_CHARS.search(revision):
        problems.append("it holds a space, control character or one of ~^:?*[\\")
    if ".." in revision or "//" in revision or "@{" in revision:
        problems.append("it contains '..', '//' or '@{'")
    if revision.startswith(("/", "-", ".")) or revision.endswith(("/", ".", ".lock")):
        problems.append("it starts with '/', '-' or '.', or ends with '/', '.' or '.lock'")
    if problems:
        raise ArtifactError(f"revision {revision!r:.80} is not a branch or tag name nor a 40-hex commit: "
                            f"{'; '.join(problems)}.")
    return revision


def _check_repo_id(repo_id: Any) -> str:
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str):
        raise ArtifactError(f"A Hub repo id must be a string 'owner/name', got {repo_id!r:.80}.")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise ArtifactError(f"{repo_id!r:.100} is not a valid Hub repo id ('owner/name'): {e}") from e
    return repo_id


def _is_repo_id(value: str) -> bool:
    try:
        _check_repo_id(value)
        return True
    except (ArtifactError, ImportError):
        return False


def from_pretrained(repo_id_or_path: str | Path, load: Callable[..., Loaded], *, revision: str | None = None,
                    token: str | None = None, endpoint: str | None = None, force_download: bool = False,
                    sha256: str | None = None, cache_dir: str | Path | None = None) -> Loaded:
    """Load from a local file or directory if one exists at `repo_id_or_path`, else download from the Hub.

    load: `load(path, sha256=...)` reads the file (`Artifact.load`); it raises `ArtifactError` on any defect.
    revision: branch, tag or 40-hex commit (Hub only). force_download: bypass the local cache.
    cache_dir: the Hub cache to use (default: huggingface_hub's, under HF_HOME).
    sha256: the expected sha256 of the artifact file's bytes (see `Artifact.load`); checked for local files too.
    A download that fails to load is re-downloaded once, bypassing the cache, before the error is raised.
    """
    check_revision(revision)
    if not isinstance(repo_id_or_path, (str, Path)):
        raise ArtifactError(f"Expected a local path or a Hub repo id, got {repo_id_or_path!r:.80}.")
    if isinstance(repo_id_or_path, str) and not repo_id_or_path.strip():
        raise ArtifactError(f"Expected a local path or a Hub repo id, got {repo_id_or_path!r}, an empty string; "
                            "for an artifact in the current folder pass '.'.")
    path = expand_user(repo_id_or_path)
    if path.exists():
        try:
            return load(path, sha256=sha256)
        except ArtifactError as e:
            note = ""
            if isinstance(repo_id_or_path, str) and not looks_like_path(repo_id_or_path) \
                    and _is_repo_id(repo_id_or_path):
                note = (f" A Hub repo of the same name was not consulted: move or rename the local "
                        f"{repo_id_or_path!r}, or run from another directory, to download it.")
            raise type(e)(f"{repo_id_or_path!s} exists locally, so it was treated as a local path: {e}{note}") from e
    if looks_like_path(repo_id_or_path):
        raise ArtifactError(f"No artifact at {path}: the path does not exist (it looks like a local path, so it was "
                            "not looked up on the Hub).")
    repo_id = _check_repo_id(repo_id_or_path)
    try:
        file = _download(repo_id, revision, token, endpoint, force_download, cache_dir)
        return load(file, sha256=sha256)
    except HubError:
        raise
    except ArtifactError as first:
        if force_download:
            raise ArtifactError(f"The artifact downloaded from {repo_id!r} is invalid: {first}") from first
        # a corrupted or stale cache entry: fetch a fresh copy once
        file = _download(repo_id, revision, token, endpoint, True, cache_dir)
        try:
            return load(file, sha256=sha256)
        except ArtifactError as second:
            raise ArtifactError(f"The artifact from {repo_id!r} is invalid even after a fresh re-download (the "
                                f"copy on the Hub is bad, or not the file you expected): {second}") from second


def _download(repo_id: str, revision: str | None, token: str | None, endpoint: str | None,
              force_download: bool, cache_dir: str | Path | None) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, FILENAME, revision=revision, token=token, endpoint=endpoint,
                               force_download=force_download, cache_dir=cache_dir)
    except Exception as e:  # HTTP, network, cache and validation errors of many types
        raise HubError(f"Could not download {FILENAME} from the Hub repo {repo_id!r}"
                       f"{f' at revision {revision!r}' if revision else ''}: {type(e).__name__}: "
                       f"{' '.join(str(e).split())}") from e
