"""The generated reference pages (docs/reference/) are what the code gives today: a changed
option, route, request field or metric without `python scripts/gen_docs_reference.py` fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_docs_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_docs_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_pages_are_up_to_date() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_check_names_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    gen = _generator()
    monkeypatch.setattr(gen, "REFERENCE", tmp_path)
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text().replace("tokenmill:num_requests_running", "gone"))
    assert gen.main(["--check"]) == 1
    assert "metrics.md" in capsys.readouterr().err


def test_pages_hold_what_the_code_has() -> None:
    gen = _generator()
    cli = gen.cli_page()
    assert "## tokenmill serve" in cli and "`--max-model-len MAX_MODEL_LEN`" in cli
    http = gen.http_page(gen.openapi_document())
    for route in ("`/v1/chat/completions`", "`/api/chat`", "`/admin/models`", "`/v1/files`"):
        assert route in http
    assert "| `max_tokens` |" in http
    assert "`tokenmill:time_to_first_token_seconds` | histogram | model_name |" in gen.metrics_page()
    env = gen.environment_page()
    assert "| `TOKENMILL_GC_FREEZE` | 1 |" in env and "| `XDG_CACHE_HOME` | ~/.cache |" in env
