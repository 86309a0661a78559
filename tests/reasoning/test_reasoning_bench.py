"""`tokenmill bench reasoning`: its synthetic stream is split as a real one would be, and the
measurement reports both modes (no timing is asserted)."""

from __future__ import annotations

import argparse
import json

from tokenmill.bench.reasoning import _chunks, add_reasoning_parser, synthetic_stream


def test_the_synthetic_stream_is_thinking_then_answer() -> None:
    stream = synthetic_stream(40)
    chunks, reasoning, content = _chunks(True), "", ""
    for out in stream:
        chunk = chunks.delta(0, out)
        for choice in chunk.choices if chunk is not None else []:
            reasoning += choice.delta.reasoning_content or ""
            content += choice.delta.content or ""
    assert reasoning.count("think") == 3 and "</think>" not in reasoning
    assert content.startswith("Let me") and len(content) > 0


def test_the_command_writes_its_result(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_reasoning_parser(parser.add_subparsers())
    out = tmp_path / "r.json"
    args = parser.parse_args(["reasoning", "--tokens", "50", "--rounds", "1",
                              "--result-file", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 50 and result["plain_us_per_token"] > 0
    assert result["parser_us_per_token"] > 0 and "overhead_pct" in result
