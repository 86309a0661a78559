"""The `tokenmill` command: serve, generate, chat, info here; bench, batch and stream in their
packages, every one registered from the `COMMANDS` table."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from tokenmill.batch.cli import add_batch_parser
from tokenmill.bench import batch as bench_batch
from tokenmill.bench import (
    beam,
    compare,
    contention,
    embed,
    fuzz,
    gpu,
    latency,
    lora,
    prefix_cache,
    rerank,
    retrieval,
    spec,
    structured,
    throughput,
)
from tokenmill.bench import serve as bench_serve
from tokenmill.chat import ChatSession, run_generate
from tokenmill.config import TOOL_CALL_PARSERS, ServerConfig
from tokenmill.engine.args import (
    add_engine_args,
    add_lora_modules_arg,
    add_sampling_args,
    engine_config_from_args,
    parse_lora_module,
    sampling_params_from_args,
)
from tokenmill.engine.llm_engine import LLMEngine, ModelInfo
from tokenmill.server.admin_cli import add_models_parser
from tokenmill.server.monitor_cli import (
    add_monitor_args,
    add_monitor_parser,
    monitor_config_from_args,
)
from tokenmill.stream.cli import add_stream_parser


def cmd_generate(args: argparse.Namespace) -> int:
    """Run `tokenmill generate`: one prompt, streamed to stdout, then a summary."""
    engine = LLMEngine(engine_config_from_args(args))
    return run_generate(engine, args.prompt, sampling_params_from_args(args))


def cmd_chat(args: argparse.Namespace) -> int:
    """Run `tokenmill chat`: read messages from the terminal until /exit or EOF."""
    engine = LLMEngine(engine_config_from_args(args))
    return ChatSession(engine, sampling_params_from_args(args), args.system).run()


def cmd_info(args: argparse.Namespace) -> int:
    """Run `tokenmill info`: load the engine and print what it runs and how."""
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
    """Run `tokenmill serve` until SIGTERM / SIGINT."""
    from tokenmill.server.launcher import run_server
    from tokenmill.server.model_registry import config_factory, served_models

    if args.model_path is not None:
        if args.model:
            raise ValueError(f"the model is given twice: as MODEL ({args.model_path!r}) and as "
                             f"--model {args.model}; give one of them")
        args.model = [args.model_path]

    config = ServerConfig(
        served_model_name=args.served_model_name, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or None,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout, auth_health_metrics=args.auth_health_metrics,
        debug_fail_at_step=args.debug_fail_at_step, allowed_hosts=_names(args.allowed_hosts),
        allowed_origins=_names(args.allowed_origins), header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, max_connections=args.max_connections,
        split_special_tokens=args.split_special_tokens, tool_call_parser=args.tool_call_parser,
        admin_key=args.admin_key or os.environ.get("TOKENMILL_ADMIN_KEY") or None,
        models_dir=args.models_dir, max_loaded_models=args.max_loaded_models,
        keep_alive=args.keep_alive if args.keep_alive > 0 else None,
        log_stats_interval=args.log_stats_interval, webui=args.webui,
        data_dir=args.data_dir, max_upload_bytes=args.max_upload_bytes,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        monitor=monitor_config_from_args(args))
    lora_modules = [parse_lora_module(v) for v in args.lora_modules]
    return run_server(served_models(args), config, config_factory(args), lora_modules)


def _names(values: list[str]) -> tuple[str, ...]:
    """Repeated or comma-separated option values as one tuple."""
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of the OpenAI-compatible HTTP server."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host, help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY)")
    g.add_argument("--admin-key", default=None,
                   help="turn the admin API on (/admin/models: load, unload, swap models "
                   "while serving) behind this key (default: $TOKENMILL_ADMIN_KEY; unset: off)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="models to load on demand: a request for a model that is not loaded "
                   "loads DIR/<model> (a GGUF file or HF folder); the admin API loads from "
                   "this folder only")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="at most N models loaded at once: the least recently used idle "
                   "on-demand model is unloaded to make room (default: no limit)")
    g.add_argument("--keep-alive", type=float, default=ServerConfig.keep_alive,
                   metavar="SECONDS", help="unload an on-demand model idle this long "
                   "(0: never; default: %(default)s)")
    g.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the web page (chat playground at /, dashboard at "
                   "/dashboard)")
    g.add_argument("--log-stats-interval", type=float, default=ServerConfig.log_stats_interval,
                   metavar="SECONDS", help="log each model's throughput, running and waiting "
                   "requests and KV cache usage this often while it works (0: never; default: "
                   "%(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the model file's name)")
    g.add_argument("--max-queue", type=int, default=ServerConfig.max_queue,
                   help="sequences that may wait beyond --max-num-seqs before 503s")
    g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--drain-timeout", type=float, default=ServerConfig.drain_timeout,
                   help="seconds SIGTERM waits for requests in flight before aborting them")
    g.add_argument("--auth-health-metrics", action="store_true",
                   help="also require the API key on /health and /metrics")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
                   help="Host names to answer besides IP addresses, localhost and this "
                   "machine's names ('.example.com': a domain and its subdomains; '*': any)")
    g.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN]",
                   help="browser origins (https://app.example.com) allowed to call the API, "
                   "with CORS; '*': any (default: none, only the server's own)")
    g.add_argument("--header-timeout", type=float, default=ServerConfig.header_timeout,
                   help="seconds a client has to send a request's headers")
    g.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout,
                   help="seconds a client has to send a request's body (then 408)")
    g.add_argument("--max-connections", type=int, default=ServerConfig.max_connections,
                   help="open connections at most; more are answered 503 and closed")
    g.add_argument("--split-special-tokens", action="store_true",
                   help="read special-token text (<|im_end|>...) in /v1/completions prompts "
                   "as plain text; chat messages always are")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   default=ServerConfig.tool_call_parser,
                   help="the format of the model's tool calls on /v1/chat/completions: hermes "
                   "(<tool_call> per call: Qwen, Hermes), smollm (<tool_call>[...]: SmolLM2), "
                   "or auto (by the chat template)")
    add_lora_modules_arg(g, "a request names one as its model (base_model_name picks the "
                         "model it runs on; default: the first text-generation model)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind "
                   "the admin key if there is one, else the API key); needs --enable-lora")
    g.add_argument("--data-dir", default=None,
                   help="folder of uploaded files and vector stores (default: tokenmill's "
                   "folder in the user's data directory)")
    g.add_argument("--max-upload-bytes", type=int, default=ServerConfig.max_upload_bytes,
                   help="larger files sent to /v1/files get 413")
    g.add_argument("--debug-fail-at-step", type=int, default=None, metavar="N",
                   help="TESTING ONLY: make the N-th engine step raise (fault injection)")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill serve`."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as `vllm serve MODEL` takes it: the same as one "
                        "--model [NAME=]PATH[,OPT] (default: the embedded models)")
    add_engine_args(p, several_models=True)
    add_serve_args(p)
    add_monitor_args(p)
    p.set_defaults(func=cmd_serve)


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill generate`."""
    p = subparsers.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    p.add_argument("prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill chat`."""
    p = subparsers.add_parser("chat", help="interactive chat with history")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)


def add_info_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill info`."""
    p = subparsers.add_parser("info", help="print model, device, dtype and the KV memory plan")
    add_engine_args(p)
    p.set_defaults(func=cmd_info)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench` and its suites (`BENCH_SUITES`)."""
    p = subparsers.add_parser("bench", help="benchmarks: load generator, throughput, latency, compare")
    suites = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for register in BENCH_SUITES:
        register(suites)


def _add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench perplexity` from tokenmill/bench/perplexity.py, a separate module.

    This parser is built for every `tokenmill` command, so a missing module leaves the
    sub-command out and a broken one only breaks `bench perplexity` itself (it then explains
    the import error), never `tokenmill serve` and the rest.
    """
    try:
        from tokenmill.bench.perplexity import add_perplexity_parser  # type: ignore[import-not-found]
    except ModuleNotFoundError as e:
        if e.name == "tokenmill.bench.perplexity":
            return
        error: ImportError = e
    except ImportError as e:
        error = e
    else:
        add_perplexity_parser(subparsers)
        return

    def unavailable(args: argparse.Namespace) -> int:
        raise ValueError(f"bench perplexity is unavailable: {error}")

    p = subparsers.add_parser("perplexity", help="(unavailable: see `bench perplexity`)")
    p.set_defaults(func=unavailable)


# Registers one sub-command on a subparsers action: its name, help, options, and its handler
# as the `func` default, all of which belong to the module that runs the command.
Registrar = Callable[[argparse._SubParsersAction], None]

# Every `tokenmill` command, in the order `tokenmill --help` lists them: the one place that
# says which commands exist, so no subpackage needs to import this module.
def add_tokenizer_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill tokenizer export`."""
    p = subparsers.add_parser("tokenizer", help="the model's tokenizer for other tools")
    sub = p.add_subparsers(dest="action", required=True)
    export = sub.add_parser("export", help="write a Hugging Face tokenizer folder (GGUF "
                            "models too), for lm-eval, aiperf, guidellm and transformers")
    export.add_argument("model", nargs="?", default=None,
                        help="GGUF file or Hugging Face folder (default: the embedded model)")
    export.add_argument("dir", help="the folder to write")
    export.set_defaults(func=cmd_tokenizer_export)


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    """Run `tokenmill tokenizer export`."""
    from tokenmill.model_loader.tokenizer_export import export_tokenizer

    for path in export_tokenizer(args.model, args.dir):
        print(path)
    return 0


COMMANDS: tuple[Registrar, ...] = (
    add_serve_parser, add_generate_parser, add_chat_parser, add_info_parser, add_bench_parser,
    add_batch_parser, add_stream_parser, add_models_parser, add_monitor_parser,
    add_tokenizer_parser,
)

# `tokenmill bench <suite>`, in the order `tokenmill bench --help` lists them.
BENCH_SUITES: tuple[Registrar, ...] = (
    bench_serve.add_serve_parser, throughput.add_throughput_parser, latency.add_latency_parser,
    compare.add_compare_parser, prefix_cache.add_prefix_cache_parser, spec.add_spec_parser,
    bench_batch.add_batch_bench_parser, gpu.add_gpu_parser, _add_perplexity_parser,
    fuzz.add_fuzz_parser, structured.add_structured_parser, retrieval.add_retrieval_parser,
    embed.add_embed_parser, rerank.add_rerank_parser, contention.add_contention_parser,
    lora.add_lora_parser, beam.add_beam_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The `tokenmill` parser with every command of `COMMANDS`."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    _accept_global_options(sub)
    return parser


def _accept_global_options(sub: argparse._SubParsersAction) -> None:
    """Let every command (and sub-command) take the global options after its name too:
    `tokenmill chat -q` as well as `tokenmill -q chat`. Their default is SUPPRESS, so a
    command without them keeps the value given before its name."""
    for p in sub.choices.values():
        if "--quiet" not in p._option_string_actions:
            p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                           help="log warnings only")
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                _accept_global_options(action)
            else:
                _show_default(action)


def _show_default(action: argparse.Action) -> None:
    """Every option's help says its default, unless it already does or has none to say."""
    default = action.default
    if (not action.help or action.help == argparse.SUPPRESS or default is None
            or default is argparse.SUPPRESS or isinstance(default, bool)
            or "default" in action.help or not action.option_strings):
        return
    action.help += " (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    """The `tokenmill` entry point: parse, set up logging, run the command; 2 on a user error."""
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
