"""Models that `llama-server -hf` (or `huggingface-cli download`) fetched: found in the Hugging Face
cache, offline. Nothing is downloaded here.

The cache keeps a repository as `<cache>/models--ORG--NAME/snapshots/<commit>/<files>`, with
`refs/main` (or another ref) naming the commit. `-hf ORG/NAME[:TAG]` picks a GGUF in that snapshot
as llama-server does: the file `-hff` names, else the first model file whose path has TAG followed
by `.` or `-` (no TAG: Q4_K_M, then Q8_0, then any model file), taking part 1 of a split model.
Sidecars (mmproj, imatrix, draft heads) are never the model.
See https://huggingface.co/docs/huggingface_hub/guides/manage-cache for the layout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# Where the cache is, in llama-server's order: the first variable that is set wins.
_CACHE_VARS = (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub"),
               ("XDG_CACHE_HOME", "huggingface/hub"), ("HOME", ".cache/huggingface/hub"))
_REPO_ID = re.compile(r"^[A-Za-z0-9_]+(?:[.-][A-Za-z0-9_]+)*/[A-Za-z0-9_]+(?:[.-][A-Za-z0-9_]+)*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    for var, sub in _CACHE_VARS:
        if env.get(var):
            return Path(env[var]) / sub if sub else Path(env[var])
    return Path.home() / ".cache" / "huggingface" / "hub"


def split_repo_tag(spec: str) -> tuple[str, str]:
    """'org/name:TAG' -> ('org/name', 'TAG'); no tag -> ''."""
    repo, _, tag = spec.partition(":")
    return repo, tag


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot a ref names: refs/main first, else the first ref with a valid commit."""
    refs = repo_dir / "refs"
    if not refs.is_dir():
        return None
    commits: dict[str, str] = {}
    for ref in sorted(refs.iterdir()):
        if ref.is_file():
            lines = ref.read_text(errors="replace").splitlines()
            if lines and _COMMIT.match(lines[0].strip()):
                commits[ref.name] = lines[0].strip()
    for name in ("main", *commits):
        if name in commits and (repo_dir / "snapshots" / commits[name]).is_dir():
            return repo_dir / "snapshots" / commits[name]
    return None


def cached_files(repo: str, environ: Mapping[str, str] | None = None) -> tuple[Path, list[str]] | None:
    """(snapshot directory, its files as relative posix paths, sorted), or None when not cached."""
    snap = _snapshot(cache_dir(environ) / ("models--" + repo.replace("/", "--")))
    if snap is None:
        return None
    files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    return snap, files


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(s in name for s in _SIDECARS)


def _first_part(path: str) -> bool:
    m = _SPLIT.search(path)
    return m is None or int(m.group(1)) == 1


def pick_model(files: list[str], tag: str) -> str | None:
    """llama-server's choice among a repository's files (see the module docstring)."""
    models = [f for f in files if _is_model(f) and _first_part(f)]
    for t in (tag,) if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in models:
            if pattern.search(f):
                return f
    return models[0] if models and not tag else None


def resolve(spec: str, hf_file: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The local path of the model `-hf spec` (and `-hff hf_file`) names; ValueError saying why not
    and what to do."""
    repo, tag = split_repo_tag(spec)
    if not _REPO_ID.match(repo):
        raise ValueError(f"-hf {spec}: not a Hugging Face repository name (ORG/NAME, optionally :TAG)")
    found = cached_files(repo, environ)
    if found is None:
        raise ValueError(
            f"-hf {spec}: {repo} is not in the Hugging Face cache ({cache_dir(environ)}), and hybridmoe does not "
            f"download models. Fetch it once (`huggingface-cli download {repo} --include '*.gguf'`, or with "
            "llama-server -hf), or pass the file with -m")
    snap, files = found
    chosen = hf_file if hf_file in files else None if hf_file else pick_model(files, tag)
    if chosen is None:
        ggufs = ", ".join(f for f in files if f.lower().endswith(".gguf")) or "none"
        what = f"no file {hf_file}" if hf_file else f"no GGUF model file{f' tagged {tag}' if tag else ''}"
        raise ValueError(f"-hf {spec}: {what} in the cached {repo} ({snap}); its GGUF files: {ggufs}")
    return str(snap / chosen)
