"""`bench spec` end to end on the embedded model, tiny: rows, speed-ups and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import build_parser


def test_bench_spec_writes_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.json"
    args = build_parser().parse_args([
        "bench", "spec", "--modes", "none,ngram", "--tasks", "code", "--max-tokens", "12",
        "--num-iters", "1", "--num-warmups", "0", "--quantization", "none", "--dtype", "float32",
        "--max-model-len", "512", "--num-kv-blocks", "64", "--result-file", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"none", "ngram"}
    assert rows["none"]["speedup"] == pytest.approx(1.0)
    assert rows["none"]["mean_acceptance_length"] is None
    assert rows["ngram"]["output_tokens"] == 12 and rows["ngram"]["same_tokens_as_first_mode"]
    assert rows["ngram"]["mean_acceptance_length"] >= 1.0
    assert "| ngram | code |" in capsys.readouterr().out
