"""What the Responses API adds before the engine sees a request: the CPU time of checking and
preparing it (input items, tools, the chat template, and for file_search the sources fitted
to the context: a second render and the chunks tokenized), against chat completions'
preparation of the same conversation. No generation runs.

    PYTHONPATH=$PWD OMP_WAIT_POLICY=PASSIVE python benchmarks/responses_prepare.py \
        --result-file benchmarks/results/responses-prepare-cpu.json

Prints a table (median and p90 of the runs, the three kinds alternated in each round) and
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

from tokenmill import LLM
from tokenmill.api.chat import prepare_chat
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.responses_api import plan_response, prepare_response
from tokenmill.api.responses_protocol import FileSearchResult, ResponsesRequest

QUESTION = "What does the handbook say about the lighthouse keeper's winter duties?"
CHUNK = ("The keeper inspects the lamp every evening, logs the weather at six, and in winter "
         "changes the code word, checks the fog horn and clears ice from the gallery. ") * 6


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--results", type=int, default=10, help="file_search results (chunks)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    engine = LLM(max_model_len=args.max_model_len, kv_cache_memory_bytes=256 << 20).engine
    hits = [FileSearchResult(file_id=f"file-{i}", filename=f"handbook-{i}.md",
                             score=1 - i / 100, text=CHUNK) for i in range(args.results)]
    plain = ResponsesRequest(input=QUESTION, instructions="Answer briefly.",
                             max_output_tokens=128)
    searched = ResponsesRequest(input=QUESTION, instructions="Answer briefly.",
                                max_output_tokens=128,
                                tools=[{"type": "file_search", "vector_store_ids": ["vs"]}])
    chat = ChatCompletionRequest(messages=[{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": QUESTION}],
                                 max_completion_tokens=128)
    kinds: dict[str, Callable[[], object]] = {
        "chat completions (prepare_chat)": lambda: prepare_chat(chat, engine),
        "responses, plain": lambda: prepare_response(plan_response(plain, []), engine, None),
        f"responses, file_search ({args.results} chunks)": lambda: prepare_response(
            plan_response(searched, []), engine, hits),
    }
    call = prepare_response(plan_response(searched, []), engine, hits)
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for fn in kinds.values():  # warm the tokenizer and template caches
        fn()
    for _ in range(args.rounds):
        for name, fn in kinds.items():
            times[name].append(_timed(fn))
    rows = [{"kind": k, "median_ms": round(statistics.median(v), 3),
             "p90_ms": round(statistics.quantiles(v, n=10)[-1], 3)} for k, v in times.items()]
    result = {"rounds": args.rounds, "max_model_len": args.max_model_len,
              "sources_in_prompt": len(call.sources),
              "prompt_tokens_with_sources": len(call.chat.engine_prompts[0]["prompt_token_ids"]),
              "cpu": platform.processor() or platform.machine(),
              # Other work on the machine inflates every row alike (the kinds alternate).
              "load_average_1min": [load_before, os.getloadavg()[0]], "rows": rows}
    print("| request | median ms | p90 ms |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['kind']} | {r['median_ms']} | {r['p90_ms']} |")
    print(f"sources in the prompt: {result['sources_in_prompt']} of {args.results}, prompt "
          f"{result['prompt_tokens_with_sources']} tokens of {args.max_model_len}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
