"""`tokenmill bench rerank` end to end on a few pairs of a small random cross-encoder: the
JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from embed_helpers import save_random_cross_encoder

from tokenmill.bench.rerank import ranking_agreement, workload
from tokenmill.cli import main


def test_workload_pairs_each_query_with_its_documents() -> None:
    first, second = workload(3, 4, 5, 9)
    assert len(first) == len(second) == 12
    assert first[0] == first[3] != first[4]
    assert len(set(second)) == 12
    assert all(5 <= len(d.split()) <= 9 for d in second)


def test_bench_rerank_writes_parity_and_throughput(tmp_path: Path, minilm_path: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "reranker"
    save_random_cross_encoder(folder, minilm_path)
    out = tmp_path / "rerank.json"
    assert main(["bench", "rerank", "--model", str(folder), "--num-queries", "2",
                 "--docs-per-query", "3", "--max-words", "30", "--repeats", "1",
                 "--dtype", "float32", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokenmill_matmuls"] == "float32"
    assert result["parity"]["max_abs_diff"] < 1e-5  # fp32 against fp32
    assert result["parity"]["same_order_per_query"] == 1.0
    assert result["parity"]["same_best_per_query"] == 1.0
    assert result["parity"]["mean_spearman"] == pytest.approx(1.0)
    t = result["throughput"]
    assert len(t["tokenmill"]["pairs_per_s"]) == 1 and t["speedup_median"] > 0
    assert result["workload"]["num_pairs"] == 6 and result["workload"]["tokens"] > 6 * 10
    assert "speedup (medians) vs sentence-transformers" in capsys.readouterr().out


def test_ranking_agreement_counts_what_changed() -> None:
    import torch

    ref = torch.tensor([0.9, 0.5, 0.1, 0.3, 0.2, 0.8])  # two queries of three documents
    same = ranking_agreement(ref, ref, 3)
    assert same == {"same_best_per_query": 1.0, "same_order_per_query": 1.0,
                    "mean_spearman": pytest.approx(1.0)}
    # The second query's two worst documents swapped: its best stays, its order does not
    # (ranks 1, 2, 0 against 2, 1, 0: Spearman 0.5).
    swapped = ranking_agreement(torch.tensor([0.9, 0.5, 0.1, 0.2, 0.3, 0.8]), ref, 3)
    assert swapped["same_best_per_query"] == 1.0
    assert swapped["same_order_per_query"] == 0.5
    assert swapped["mean_spearman"] == pytest.approx((1.0 + 0.5) / 2)
    # Its best changed too.
    moved = ranking_agreement(torch.tensor([0.9, 0.5, 0.1, 0.9, 0.2, 0.8]), ref, 3)
    assert moved["same_best_per_query"] == 0.5
