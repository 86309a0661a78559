"""`bench perplexity`: window bookkeeping and the number itself, against an independent loop."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from quant_helpers import PagedKVCache, run_step, tiny_arch, tiny_model

from tokenmill.bench.perplexity import (
    add_perplexity_parser,
    default_text_path,
    main,
    perplexity,
    window_spans,
)
from tokenmill.quant import quantize_model

TOKENS = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("n, context, stride", [(150, 64, 32), (150, 64, 64), (10, 64, 16),
                                                (101, 50, 7), (2, 2, 1)])
def test_windows_score_every_token_once(n: int, context: int, stride: int) -> None:
    spans = window_spans(n, context, stride)
    targets = [t for _, end, first in spans for t in range(first, end)]
    if stride < context:
        assert targets == list(range(1, n))
    else:  # disjoint windows: each window's first token has no history
        assert targets == [t for t in range(1, n) if t % context]
    for begin, end, first in spans:
        assert end - begin <= context and begin < first
        assert first - begin >= min(context - stride, first - begin - 1, 1)


def test_window_options_are_checked() -> None:
    with pytest.raises(ValueError, match="stride"):
        window_spans(100, 64, 65)
    with pytest.raises(ValueError, match="context"):
        window_spans(100, 1, 1)
    with pytest.raises(ValueError, match="at least 2"):
        window_spans(1, 64, 32)


def _reference_nll(model: torch.nn.Module, ids: list[int], context: int, stride: int) -> float:
    """Mean NLL the slow way: every window from scratch, each target taken where first seen."""
    seen: set[int] = set()
    nlls: list[float] = []
    for begin in range(0, len(ids), stride):
        window = ids[begin:begin + context]
        if len(window) < 2:
            break
        logits = run_step(model, PagedKVCache.for_arch(model.config), [(0, window)])[0]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        for row in range(len(window) - 1):
            target = begin + row + 1
            if target not in seen:
                seen.add(target)
                nlls.append(-logprobs[row, window[row + 1]].item())
        if begin + context >= len(ids):
            break
    assert sorted(seen) == list(range(1, len(ids)))
    return sum(nlls) / len(nlls)


@pytest.mark.parametrize("context, stride", [(256, 256), (64, 32), (48, 20)])
def test_perplexity_is_exp_mean_nll(context: int, stride: int) -> None:
    model = tiny_model(tiny_arch())
    result = perplexity(model, TOKENS, context=context, stride=stride)
    expected = _reference_nll(model, TOKENS, context, stride)
    assert result.num_scored == len(TOKENS) - 1
    assert math.isfinite(result.perplexity)
    assert result.mean_nll == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)


def test_quantized_perplexity_is_close() -> None:
    model = tiny_model(tiny_arch())
    base = perplexity(model, TOKENS, context=64, stride=32).perplexity
    quantize_model(model, "int8")
    assert perplexity(model, TOKENS, context=64, stride=32).perplexity == pytest.approx(
        base, rel=0.05)


def test_default_text_is_long_english() -> None:
    path = default_text_path()
    assert os.path.isfile(path) and path.endswith("LICENSE.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert len(text.split()) > 5000 and "GNU GENERAL PUBLIC LICENSE" in text


def test_command_writes_json_and_markdown(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out, md = tmp_path / "ppl.json", tmp_path / "ppl.md"
    # dummy weights: the embedded model's shapes without reading its tensors
    rc = main(["--load-format", "dummy", "--quantization", "int8", "--text", str(text),
               "--max-tokens", "64", "--context", "32", "--stride", "16", "--threads", "1",
               "--result-file", str(out), "--markdown", str(md)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["quantization"] == "int8" and run["num_scored"] == 63
    assert math.isfinite(run["perplexity"]) and run["weight_mib"] < 200
    assert "| int8 |" in md.read_text()
    assert main(["--load-format", "dummy", "--text", str(tmp_path / "missing.txt")]) == 2
    # an int4 group size other than 32: float weights quantized after loading
    assert main(["--load-format", "dummy", "--quantization", "int4", "--group-size", "64",
                 "--text", str(text), "--max-tokens", "40", "--context", "32", "--stride", "16",
                 "--threads", "1", "--result-file", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["label"] == "int4 g64" and run["weights_from"].startswith("float")


def test_parser_registers_as_a_bench_subcommand() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_perplexity_parser(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["perplexity", "--quantization", "int4", "--context", "128"])
    assert args.quantization == "int4" and args.context == 128 and args.stride == 256
    assert callable(args.func)
