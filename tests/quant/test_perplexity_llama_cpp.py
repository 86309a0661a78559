"""`bench perplexity --recipe llama.cpp`: llama-perplexity's chunks, BOS and scored half, against
independent loops (a tiny model, and the embedded SmolLM2 scored by transformers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from quant_helpers import logits_of, tiny_arch, tiny_model

from tokenmill.bench.perplexity import (
    FIXED_TEXT_PATH,
    llama_cpp_spans,
    main,
    perplexity,
    run_one,
)

TOKENS = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(11)).tolist()


def _chunk_nll(logits: torch.Tensor, chunk: list[int]) -> list[float]:
    """llama.cpp's scored half of one chunk: logits of positions n/2 .. n-2 predict the next."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    n = len(chunk)
    return [-logprobs[pos, chunk[pos + 1]].item() for pos in range(n // 2, n - 1)]


def _reference_ppl(score, ids: list[int], context: int, bos: int | None) -> float:  # noqa: ANN001
    """perplexity.cpp's loop written out: chunk i is ids[i*n:(i+1)*n], BOS first if any."""
    nlls: list[float] = []
    for i in range(len(ids) // context):
        chunk = ids[i * context:(i + 1) * context]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        nlls += _chunk_nll(score(chunk), chunk)
    return math.exp(sum(nlls) / len(nlls))


def test_spans_are_llama_cpps_chunks() -> None:
    assert llama_cpp_spans(150, 64) == [(0, 64, 33), (64, 128, 97)]  # the tail 128..150 dropped
    assert llama_cpp_spans(1030, 512) == [(0, 512, 257), (512, 1024, 769)]
    spans = llama_cpp_spans(3000, 512)
    assert len(spans) == 5 and sum(e - f for _, e, f in spans) == 5 * 255  # llama.cpp's count
    with pytest.raises(ValueError, match="at least 1024"):
        llama_cpp_spans(1000, 512)
    with pytest.raises(ValueError, match="context"):
        llama_cpp_spans(100, 2)


@pytest.mark.parametrize("bos", [None, 5])
def test_llama_cpp_recipe_matches_an_independent_loop(bos: int | None) -> None:
    model = tiny_model(tiny_arch())
    result = perplexity(model, TOKENS, context=64, recipe="llama.cpp", bos_token_id=bos)
    expected = _reference_ppl(lambda chunk: logits_of(model, chunk), TOKENS, 64, bos)
    assert result.recipe == "llama.cpp" and result.num_windows == 2
    assert result.num_scored == 2 * 31
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    # BOS replaces the chunk's first token: a different number when a BOS is given
    other = perplexity(model, TOKENS, context=64, recipe="llama.cpp", bos_token_id=None)
    assert (bos is None) == (other.perplexity == pytest.approx(result.perplexity, rel=1e-9))


def test_unknown_recipe_is_refused() -> None:
    with pytest.raises(ValueError, match="recipe"):
        perplexity(tiny_model(tiny_arch()), TOKENS, recipe="wikitext")


def test_llama_cpp_tokens_drop_one_trailing_newline_as_its_file_reader_does() -> None:
    from tokenmill.bench.perplexity import _tokens
    from tokenmill.model_loader.gguf import embedded_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(embedded_model_path())
    text = Path(FIXED_TEXT_PATH).read_text(encoding="utf-8")
    assert text.endswith("all nations.\n")
    ids, bos = _tokens(tokenizer, text, "llama.cpp")
    # llama-perplexity -f counts 2879 tokens of this file with SmolLM2 (which adds no BOS)
    assert bos is None and ids == tokenizer.encode(text[:-1], add_special_tokens=True)
    assert len(ids) == 2879
    assert _tokens(tokenizer, text, "sliding")[0] == tokenizer.encode(text, False)


def test_fixed_text_is_shipped_and_long_enough() -> None:
    text = Path(FIXED_TEXT_PATH).read_text(encoding="utf-8")
    assert text.isascii() and len(text.split()) > 2000
    assert text.startswith("In Congress, July 4, 1776.")


def test_smollm_matches_transformers_on_the_same_weights(tmp_path: Path, hf_smollm) -> None:  # noqa: ANN001
    """The embedded SmolLM2, dequantized (quantization none, fp32), scored by the command and by
    transformers loading the same GGUF: the same perplexity."""
    text = tmp_path / "text.txt"
    text.write_text(Path(FIXED_TEXT_PATH).read_text(encoding="utf-8")[:900])
    out = tmp_path / "ppl.json"
    argv = ["--quantization", "none", "--dtype", "float32", "--threads", "1", "--text",
            str(text), "--recipe", "llama.cpp", "--context", "64", "--result-file", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["recipe"] == "llama.cpp" and run["num_windows"] >= 2
    from tokenmill.model_loader.gguf import embedded_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(embedded_model_path())
    ids = tokenizer.encode(text.read_text(), add_special_tokens=True)
    assert run["num_tokens"] == len(ids)

    @torch.inference_mode()
    def hf_logits(chunk: list[int]) -> torch.Tensor:
        return hf_smollm(torch.tensor([chunk])).logits[0]

    expected = _reference_ppl(hf_logits, ids, 64, None)  # SmolLM2's GGUF adds no BOS
    assert run["perplexity"] == pytest.approx(expected, rel=1e-4)
    # the next ordinary run (the default recipe) is answered as before
    import argparse

    args = argparse.Namespace(**{**vars(_parsed(argv)), "recipe": "sliding", "stride": 32})
    assert run_one(args)["num_scored"] == len(tokenizer.encode(text.read_text(), False)) - 1


def _parsed(argv: list[str]):  # noqa: ANN202
    import argparse

    from tokenmill.bench.perplexity import add_perplexity_args

    parser = argparse.ArgumentParser()
    add_perplexity_args(parser)
    return parser.parse_args(argv)
