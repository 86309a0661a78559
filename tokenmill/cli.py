"""The `tokenmill` command: generate, chat, info."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator

from tokenmill.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.engine.llm_engine import LLMEngine, ModelInfo
from tokenmill.engine.output_processor import OutputKind
from tokenmill.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: embedded "
                        "SmolLM2-135M-Instruct); with --load-format dummy also a preset: "
                        "llama-3.1-8b, qwen3-0.6b")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    g.add_argument("--quantization", default="auto",
                   choices=["auto", "none", "int8", "int4", "fp8"],
                   help="int8 per channel or int4 in groups of 32 (weight-only), fp8 (e4m3 "
                        "weights and per-token activations); auto keeps a GGUF file's Q4 (int4) "
                        "or Q5-Q8 (int8) weights compact on the CPU and is none otherwise")
    g.add_argument("--device", default="auto")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: all cores, shared among the ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs (or N CPU processes)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.2,
                   help="share of free memory for the KV cache (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's total memory the engine may use, weights included; "
                        "the KV cache gets the rest after a profiling step (CUDA)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every decode step eagerly (CUDA)")
    g.add_argument("--cuda-graph-max-batch-size", type=int, default=None,
                   help="largest decode batch replayed from a CUDA graph (default: "
                        "--max-num-seqs)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes (--no-prefix-caching: off)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculative", default="none", choices=["none", "ngram", "draft"],
                   help="speculative decoding: ngram (prompt lookup) or draft (needs "
                        "--speculative-model)")
    g.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="draft model with the target's tokenizer, or self:N for the target's "
                        "first N layers (implies --speculative draft)")
    g.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="draft tokens verified per step")
    g.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram prompt lookup uses")
    g.add_argument("--ngram-max", type=int, default=4, help="longest n-gram prompt lookup uses")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          load_format=args.load_format, seed=args.seed,
                          quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        device=DeviceConfig(device=args.device, num_threads=args.threads,
                            enforce_eager=args.enforce_eager,
                            cuda_graph_max_batch_size=args.cuda_graph_max_batch_size),
        speculative=SpeculativeConfig.from_options(
            args.speculative, args.speculative_model,
            num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
            ngram_max=args.ngram_max),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=args.stop)


def stream_text(engine: LLMEngine, prompt: str | dict, params: SamplingParams) -> Iterator[str]:
    """Yield the text of one request as it is generated."""
    rid = f"cli-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params, kind=OutputKind.DELTA)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.outputs[0].text:
                    yield out.outputs[0].text
    finally:
        engine.abort_request(rid)  # no-op when finished; frees the request on Ctrl-C


def cmd_generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    params = sampling_params_from_args(args)
    for delta in stream_text(engine, args.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    params = sampling_params_from_args(args)
    tok = engine.tokenizer
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("tokenmill chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template(history, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        reply = []
        try:
            for delta in stream_text(engine, prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except ValueError as e:  # e.g. the history outgrew the context
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            pass
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    engine = LLMEngine(engine_config_from_args(args))
    info = engine.model_info()
    rows = [
        ("model", info.path),
        ("architecture", info.architecture),
        ("parameters", f"{info.num_parameters / 1e6:.1f} M"),
        ("quantization", info.quantization),
        ("weights in memory", f"{info.weight_bytes / 2**20:.0f} MiB"),
        ("layers / heads / kv heads / head dim",
         f"{info.num_hidden_layers} / {info.num_attention_heads} / "
         f"{info.num_key_value_heads} / {info.head_dim}"),
        ("vocab size", str(info.vocab_size)),
        ("device", info.device),
        ("dtype", info.dtype),
        ("threads", str(torch.get_num_threads())),
        ("attention backend", info.attention_backend),
        ("decode CUDA graphs", _describe_graphs(info)),
        ("max model len", str(info.max_model_len)),
        ("kv cache", info.kv_cache.describe().removeprefix("KV cache: ")),
        ("torch", torch.__version__),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _describe_graphs(info: ModelInfo) -> str:
    sizes = info.decode_graph_sizes
    if not sizes:
        return "off"
    return (f"batch sizes {sizes[0]}..{sizes[-1]} ({len(sizes)} graphs), "
            f"contexts up to {info.decode_graph_max_seq_len}")


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.launcher import run_server
    from tokenmill.server.state import ServerConfig

    config = ServerConfig(
        served_model_name=args.served_model_name, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or None,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout, auth_health_metrics=args.auth_health_metrics,
        debug_fail_at_step=args.debug_fail_at_step)
    return run_server(engine_config_from_args(args), config)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of the OpenAI-compatible HTTP server."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the model file's name)")
    g.add_argument("--max-queue", type=int, default=128,
                   help="sequences that may wait beyond --max-num-seqs before 503s")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies get 413")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight before aborting them")
    g.add_argument("--auth-health-metrics", action="store_true",
                   help="also require the API key on /health and /metrics")
    g.add_argument("--debug-fail-at-step", type=int, default=None, metavar="N",
                   help="TESTING ONLY: make the N-th engine step raise (fault injection)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    p.add_argument("prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with history")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("info", help="print model, device, dtype and the KV memory plan")
    add_engine_args(p)
    p.set_defaults(func=cmd_info)

    add_bench_parser(sub)
    add_batch_and_stream_parsers(sub)
    return parser


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`tokenmill bench serve|throughput|latency|compare|spec|perplexity` (tokenmill/bench/)."""
    from tokenmill.bench import add_bench_parsers

    p = sub.add_parser("bench", help="benchmarks: load generator, throughput, latency, compare")
    add_bench_parsers(p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK"))


def add_batch_and_stream_parsers(sub: argparse._SubParsersAction) -> None:
    """`tokenmill batch` (tokenmill/batch/) and `tokenmill stream` (tokenmill/stream/)."""
    from tokenmill.batch.cli import add_batch_parser
    from tokenmill.stream.cli import add_stream_parser

    add_batch_parser(sub)
    add_stream_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
