"""`tokenmill bench embed` end to end on a few sentences: the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main


def test_bench_embed_writes_parity_and_throughput(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--num-sentences", "8", "--repeats", "1", "--no-st-bf16",
                 "--dtype", "float32", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokenmill_matmuls"] == "float32"
    assert result["parity"]["num_sentences"] >= 100
    assert result["parity"]["min_cosine"] > 0.9999  # fp32 against fp32
    assert "parity_st_bf16" not in result
    t = result["throughput"]
    assert set(t) == {"tokenmill", "sentence_transformers", "speedup_median"}
    assert len(t["tokenmill"]["sentences_per_s"]) == 1 and t["speedup_median"] > 0
    assert result["workload"]["num_sentences"] == 8
    assert "speedup (medians) vs sentence-transformers fp32" in capsys.readouterr().out
