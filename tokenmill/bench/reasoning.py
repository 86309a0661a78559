"""What the reasoning parser costs a stream: the same synthetic stream of DELTA outputs (a
thinking, then an answer, one token each) turned into chat chunks with the qwen3 parser and
without it, alternated over rounds; the extra microseconds per token, and that as a share of a
decode step of ``--step-ms`` (the time between two tokens of one stream at the batch size
served: the parser's work happens once per token of every stream, on the server's thread).

No model runs: the engine's side is the same with and without the parser.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

from tokenmill.api.chat import ChatCall
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.reasoning import PARSERS, ReasoningReader
from tokenmill.sampling_params import SamplingParams

# Words a model writes, one token each: thinking first, then the answer.
_WORDS = (" Let", " me", " think", " about", " this", " carefully", ".", "\n")


def synthetic_stream(tokens: int) -> list[Any]:
    """DELTA outputs of one sequence: half thinking, ``</think>``, half answer."""
    half = tokens // 2
    pieces = [_WORDS[i % len(_WORDS)] for i in range(half)] + ["\n</think>\n\n"] + \
        [_WORDS[i % len(_WORDS)] for i in range(tokens - half - 1)]
    return [SimpleNamespace(outputs=[SimpleNamespace(
        index=0, text=p, token_ids=[100 + i % 50], finished=i == len(pieces) - 1,
        finish_reason="stop" if i == len(pieces) - 1 else None, stop_reason=None,
        logprobs=None)]) for i, p in enumerate(pieces)]


def _chunks(reasoning: bool) -> Any:
    reader = ReasoningReader(PARSERS["qwen3"], True, (1,), 2) if reasoning else None
    call = ChatCall(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), [],
                    SamplingParams(), None, None, reader)  # type: ignore[arg-type]
    return call.chunks("m", "id", 0)


def seconds_per_token(stream: list[Any], reasoning: bool) -> float:
    """The time to build (and serialise, as the server does) one stream's chunks, per token."""
    chunks = _chunks(reasoning)
    start = time.perf_counter()
    for out in stream:
        chunk = chunks.delta(0, out)
        if chunk is not None:
            chunk.model_dump_json()
    return (time.perf_counter() - start) / len(stream)


def measure(tokens: int = 2000, rounds: int = 9, step_ms: float = 20.0) -> dict[str, Any]:
    """Median microseconds per token with and without the parser (rounds alternated), the
    difference, and the difference as a percentage of a ``step_ms`` decode step."""
    stream = synthetic_stream(tokens)
    plain, parsed = [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for reasoning in order:
            (parsed if reasoning else plain).append(seconds_per_token(stream, reasoning))
    plain_us, parsed_us = statistics.median(plain) * 1e6, statistics.median(parsed) * 1e6
    extra = parsed_us - plain_us
    return {"tokens": tokens, "rounds": rounds, "plain_us_per_token": round(plain_us, 3),
            "parser_us_per_token": round(parsed_us, 3), "extra_us_per_token": round(extra, 3),
            "step_ms": step_ms, "overhead_pct": round(100 * extra / (step_ms * 1000), 4)}


def cmd_reasoning(args: argparse.Namespace) -> int:
    """`tokenmill bench reasoning`: print (and write) the measurement."""
    result = measure(args.tokens, args.rounds, args.step_ms)
    text = json.dumps(result, indent=2)
    print(text)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


def add_reasoning_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench reasoning`."""
    p = subparsers.add_parser("reasoning", help="the reasoning parser's cost per streamed "
                              "token", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the synthetic stream")
    p.add_argument("--rounds", type=int, default=9, help="alternated rounds per mode")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="the decode step the overhead is a share of (ms between two tokens of "
                        "a stream at the served batch size)")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_reasoning)
