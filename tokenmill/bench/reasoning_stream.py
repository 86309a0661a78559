"""What the reasoning and tool-call parsers cost end to end: the same streamed chat requests
through two `tokenmill serve` processes of one random-weight Qwen3, one with
``--reasoning-parser qwen3`` and the requests' ``tools`` read by the Hermes parser, the other
with ``--reasoning-parser none`` and no tools (its prompts written out with the same tool
block, so both prefill the same tokens). Greedy, ``ignore_eos`` and one ``max_tokens``: both
decode the same tokens. Rounds alternate (AB, BA, ...) so a drift of the machine lands on both
alike; the overhead is the median over the rounds' pairs of the drop in output tokens/s, and,
less sensitive to other load on the machine, the extra server CPU time per output token.

The model (written here, weights random at load: ``--load-format dummy``) has a word-level
tokenizer with Qwen3's chat and thinking markers and a template whose generation prompt opens
the thinking unless ``enable_thinking`` is false. Half the requests think (every token goes to
``reasoning_content``), half do not (every token is content, read for tool calls): both
parsers' paths run on every token, as in a served reasoning model's answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.procs import ServerProcess, free_port, start_server
from tokenmill.bench.report import command_line, hardware, markdown_table, now_iso, write_json

MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant "
    "{%- if enable_thinking is defined and not enable_thinking %} <think> </think> "
    "{%- else %} <think> {%- endif %}{%- endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def write_model(folder: Path, hidden: int, layers: int, vocab: int = 512) -> Path:
    """A Qwen3 config (weights: random at load) and its word-level tokenizer: words
    "w0".."wN", then MARKERS (the chat markers special, the others plain, as Qwen3's)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    words = vocab - len(MARKERS)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in MARKERS[:2]])
    tok.add_tokens([AddedToken(t, special=False) for t in MARKERS[2:]])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": MARKERS[1], "chat_template": TEMPLATE}))
    heads = max(hidden // 64, 1)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": max(heads // 2, 1), "head_dim": 64,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": True, "torch_dtype": "float32",
              "bos_token_id": words, "eos_token_id": words + 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def request_bodies(n: int, prompt_words: int, max_tokens: int, parsed: bool,
                   seed: int = 0) -> list[dict[str, Any]]:
    """The chat bodies of one round: ``parsed`` sends the tools (read by the server's parser);
    otherwise the same prompt with the tool block already written in (see the module
    docstring). Every other request turns thinking off."""
    from tokenmill.api.protocol import ChatCompletionRequest
    from tokenmill.api.tool_parsers import HermesParser
    from tokenmill.api.tools import check_tools, tool_prompt

    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        words = " ".join(f"w{rng.randrange(400)}" for _ in range(prompt_words))
        messages = [{"role": "user", "content": words}]
        body: dict[str, Any] = {
            "model": "m", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": i % 2 == 0}}
        req = ChatCompletionRequest(messages=messages, tools=TOOLS)
        if parsed:
            body |= {"messages": messages, "tools": TOOLS}
        else:
            body["messages"] = tool_prompt(check_tools(req), HermesParser(), messages,
                                           TEMPLATE)[0]
        bodies.append(body)
    return bodies


@dataclass
class Stream:
    """What one streamed answer brought: tokens, prompt tokens, and its text by channel."""

    completion_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    reasoning_chars: int = 0
    content_chars: int = 0


async def _one(client: Any, url: str, body: dict[str, Any]) -> Stream:
    out = Stream()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            out.chunks += 1
            for c in chunk.get("choices") or []:
                out.reasoning_chars += len(c["delta"].get("reasoning_content") or "")
                out.content_chars += len(c["delta"].get("content") or "")
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
    return out


async def run_round(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[Stream]]:
    """Every body streamed at once; the wall time and each stream."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(_one(client, url, b) for b in bodies))
        return time.perf_counter() - start, list(streams)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and its live descendants so far (Linux /proc;
    0 elsewhere): the server's own work, which other load on the machine does not inflate
    as it inflates wall time."""
    ticks, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.0


@dataclass
class Mode:
    """The rounds of one server: tokens/s and server CPU ms per output token of each, and
    the last round's streams."""

    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    cpu_ms_per_token: list[float] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        s = self.streams
        return {"median_tokens_per_s": round(statistics.median(self.tokens_per_s), 2),
                "tokens_per_s": [round(t, 2) for t in self.tokens_per_s],
                "median_cpu_ms_per_token": round(statistics.median(self.cpu_ms_per_token), 4),
                "cpu_ms_per_token": [round(t, 4) for t in self.cpu_ms_per_token],
                "output_tokens_per_round": sum(x.completion_tokens for x in s),
                "prompt_tokens_per_round": sum(x.prompt_tokens for x in s),
                "chunks_per_round": sum(x.chunks for x in s),
                "reasoning_chars": sum(x.reasoning_chars for x in s),
                "content_chars": sum(x.content_chars for x in s)}


def _serve(model: Path, parsed: bool, args: argparse.Namespace) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--model", f"m={model}",
           "--load-format", "dummy", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", str(args.requests), "--seed", "0",
           "--reasoning-parser", "qwen3" if parsed else "none", "--tool-call-parser", "hermes",
           *(["--device", args.device] if args.device else [])]
    return start_server(cmd, port)


def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Both servers up, a warm-up round each, then ``args.rounds`` alternated rounds."""
    modes = {False: Mode("plain"), True: Mode("parsers")}
    servers = {parsed: _serve(model, parsed, args) for parsed in (False, True)}
    bodies = {p: request_bodies(args.requests, args.prompt_words, args.max_tokens, p)
              for p in (False, True)}
    try:
        for parsed in (False, True):  # warm-up: first-call costs out of the timed rounds
            asyncio.run(run_round(servers[parsed].base_url, bodies[parsed]))
        for r in range(args.rounds):
            for parsed in ((False, True) if r % 2 == 0 else (True, False)):
                server, mode = servers[parsed], modes[parsed]
                cpu = cpu_seconds(server.proc.pid)
                wall, streams = asyncio.run(run_round(server.base_url, bodies[parsed]))
                tokens = sum(s.completion_tokens for s in streams)
                mode.tokens_per_s.append(tokens / wall)
                mode.cpu_ms_per_token.append(
                    1000 * (cpu_seconds(server.proc.pid) - cpu) / tokens)
                mode.streams = streams
    finally:
        for s in servers.values():
            s.stop()
    plain, parsed_ = modes[False].summary(), modes[True].summary()
    for key in ("output_tokens_per_round", "prompt_tokens_per_round"):
        if plain[key] != parsed_[key]:
            raise RuntimeError(f"the two modes differ in {key}: {plain[key]} vs {parsed_[key]}")
    # Each round's pair ran back to back: the median of the pairs' ratios sheds the drift of
    # a shared machine better than the ratio of two medians.
    pairs = zip(modes[False].tokens_per_s, modes[True].tokens_per_s, strict=True)
    drop = statistics.median(1 - b / a for a, b in pairs)
    cpu_pairs = zip(modes[False].cpu_ms_per_token, modes[True].cpu_ms_per_token, strict=True)
    cpu = statistics.median(b / a - 1 if a > 0 else float("nan") for a, b in cpu_pairs)
    return {"plain": plain, "parsers": parsed_, "overhead_pct": round(100 * drop, 2),
            "cpu_overhead_pct": round(100 * cpu, 2)}


def markdown(result: dict[str, Any]) -> str:
    """The result as a short markdown page: the command, the hardware and the table."""
    rows = [[name, result[key]["median_tokens_per_s"],
             " ".join(f"{t:.0f}" for t in result[key]["tokens_per_s"]),
             result[key]["median_cpu_ms_per_token"]]
            for name, key in (("--reasoning-parser none, no tools", "plain"),
                              ("--reasoning-parser qwen3 + hermes tools", "parsers"))]
    return (f"# Reasoning and tool parsers: end-to-end streaming overhead\n\n"
            f"{now_iso()} on {result['hardware']['cpu']} ({result['hardware']['cores']} "
            f"cores), device {result['device']}, load average (1 min) "
            f"{result['load_average_1m'][0]} before, {result['load_average_1m'][1]} after."
            f"\n\n```\n{result['command']}\n```\n\n"
            f"{result['workload']}\n\n"
            + markdown_table(["server", "median output tok/s", "rounds (tok/s)",
                              "server CPU ms / output token"], rows)
            + f"\n\nOverhead: **{result['overhead_pct']}%** of the output tokens/s (median "
            f"of the rounds' pairs; goal < 2%); **{result['cpu_overhead_pct']}%** more server "
            "CPU time per output token (median of the pairs).\n")


def cmd_reasoning_stream(args: argparse.Namespace) -> int:
    """`tokenmill bench reasoning-stream`: measure, print, write JSON (and markdown)."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tokenmill-reasoning-stream-") as tmp:
        model = write_model(Path(tmp) / "qwen3-thinking", args.hidden_size, args.num_layers)
        result = measure(args, model)
    result |= {
        "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "command": command_line("tokenmill bench reasoning-stream", sys.argv[3:]),
        "hardware": hardware(), "device": args.device or "auto",
        "workload": (f"{args.requests} concurrent streamed chats per round, {args.rounds} "
                     f"rounds alternated, greedy, {args.prompt_words}-word prompts, "
                     f"{args.max_tokens} output tokens each (ignore_eos); random Qwen3, hidden "
                     f"{args.hidden_size}, {args.num_layers} layers; half the requests "
                     "think, half answer (read for tool calls)."),
        "date": now_iso()}
    print(markdown(result))
    if args.result_file:
        write_json(args.result_file, result)
        Path(args.result_file).with_suffix(".md").write_text(markdown(result))
    return 0


def add_reasoning_stream_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench reasoning-stream`."""
    p = subparsers.add_parser("reasoning-stream", help="the reasoning and tool parsers' "
                              "overhead on end-to-end streaming throughput",
                              description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8, help="concurrent streams per round")
    p.add_argument("--rounds", type=int, default=6, help="alternated rounds per server")
    p.add_argument("--prompt-words", type=int, default=64, help="prompt length (tokens)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--hidden-size", type=int, default=512, help="the random Qwen3's width")
    p.add_argument("--num-layers", type=int, default=4, help="the random Qwen3's depth")
    p.add_argument("--device", default=None, help="the servers' --device (default: auto)")
    p.add_argument("--result-file", default=None,
                   help="write the result JSON here (and markdown beside it, .md)")
    p.set_defaults(func=cmd_reasoning_stream)
