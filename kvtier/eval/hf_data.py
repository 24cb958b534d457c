"""Benchmark data from the user's Hugging Face cache, offline: a dataset repository's snapshot (what
``hf download --repo-type dataset <repo>`` fetched into ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``) and its files
(JSON lines, JSON, a zip of them, or parquet with the ``[bench]`` extra's pyarrow). kvtier never downloads: a
dataset that is not there is one ConfigError naming the command that fetches it.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

from kvtier.errors import ConfigError, MissingDependencyError


def fetch_command(repo: str) -> str:
    return f"hf download --repo-type dataset {repo}"


def dataset_folder(repos: str | tuple[str, ...]) -> Path:
    """The cached snapshot of the first of ``repos`` (a dataset and its older names) in the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from kvtier.models import hub_cache

    repos = (repos,) if isinstance(repos, str) else repos
    for repo in repos:
        try:
            return Path(snapshot_download(repo, repo_type="dataset", cache_dir=hub_cache(), local_files_only=True))
        except LocalEntryNotFoundError:
            continue
    raise ConfigError("task", f"dataset {repos[0]} is not in the Hugging Face cache at {hub_cache()}; kvtier never "
                              f"downloads: fetch it once with `{fetch_command(repos[0])}`")


def dataset_file(repos: str | tuple[str, ...], prefix: str, suffix: str) -> Path:
    """The first file of the cached dataset whose path (relative to the snapshot) starts with ``prefix`` and ends
    with ``suffix``; ConfigError naming the dataset and the file when it has none."""
    folder = dataset_folder(repos)
    found = sorted(p for p in folder.rglob("*") if p.is_file() and str(p.relative_to(folder)).startswith(prefix)
                   and p.name.endswith(suffix))
    if not found:
        repo = repos if isinstance(repos, str) else repos[0]
        raise ConfigError("task", f"the cached {repo} at {folder} has no {prefix}*{suffix}; fetch it whole with "
                                  f"`{fetch_command(repo)}`")
    return found[0]


def read_rows(path: Path, member: str | None = None) -> list[dict]:
    """The records of a ``.jsonl``, ``.json`` (a list), ``.parquet`` file, or of the ``member`` (one of those) of a
    ``.zip``."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            return parse_rows(member, z.read(member))
    return parse_rows(path.name, path.read_bytes())


def parse_rows(name: str, data: bytes) -> list[dict]:
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    if name.endswith(".json"):
        return json.loads(data.decode("utf-8"))
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise MissingDependencyError("pyarrow", "bench", f"reading {name}") from None
        return pq.read_table(io.BytesIO(data)).to_pylist()
    raise ConfigError("task", f"{name}: kvtier reads .jsonl, .json and .parquet benchmark files")
