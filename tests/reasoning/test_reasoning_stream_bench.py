"""`tokenmill bench reasoning-stream`: both servers prefill and decode the same tokens, the
parsed one splits thinking from answers, and the result is written (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.bench.reasoning_stream import (
    TEMPLATE,
    add_reasoning_stream_parser,
    request_bodies,
    write_model,
)
from tokenmill.tokenizer import Tokenizer


def test_both_modes_render_the_same_prompt(tmp_path: Path) -> None:
    from tokenmill.api.chat import render_prompt
    from tokenmill.api.protocol import ChatCompletionRequest
    from tokenmill.api.tool_parsers import HermesParser
    from tokenmill.api.tools import check_tools

    tok = Tokenizer.from_hf_dir(str(write_model(tmp_path / "m", hidden=64, layers=1)))
    assert tok.chat_template == TEMPLATE
    plain, parsed = request_bodies(2, 8, 4, False), request_bodies(2, 8, 4, True)
    for a, b in zip(plain, parsed, strict=True):
        assert "tools" not in a and b["tools"]
        req = ChatCompletionRequest(**{k: v for k, v in b.items() if k != "stream_options"})
        with_tools = render_prompt(tok, req, 2048, (check_tools(req), HermesParser()))[0]
        without = render_prompt(tok, ChatCompletionRequest(
            **{k: v for k, v in a.items() if k != "stream_options"}), 2048)[0]
        assert with_tools == without and "get_weather" in without


def test_the_command_measures_both_servers(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_reasoning_stream_parser(parser.add_subparsers())
    out = tmp_path / "r.json"
    args = parser.parse_args(["reasoning-stream", "--requests", "2", "--rounds", "1",
                              "--max-tokens", "6", "--prompt-words", "4", "--hidden-size", "64",
                              "--num-layers", "1", "--result-file", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    plain, parsed = result["plain"], result["parsers"]
    assert plain["output_tokens_per_round"] == parsed["output_tokens_per_round"] == 12
    assert plain["prompt_tokens_per_round"] == parsed["prompt_tokens_per_round"]
    # One request thinks, one answers: only the parsed server tells them apart.
    assert plain["reasoning_chars"] == 0 and plain["content_chars"] > 0
    assert parsed["reasoning_chars"] > 0 and parsed["content_chars"] > 0
    assert "overhead_pct" in result and result["hardware"]["cpu"]
    assert "tokenmill bench reasoning-stream" in out.with_suffix(".md").read_text()
