"""The `tokenmill` command: every sub-command registered from the `COMMANDS` table.

Only the command being run has its parser built (and its modules imported): `tokenmill
--help`, `pull`, `list` and `chat --url` never import torch. Interactive commands log warnings
only unless -v; serve, bench, batch and stream log at INFO unless -q.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill import envs

if TYPE_CHECKING:  # imported when a command runs, not to list the commands
    from tokenmill.chat_remote import ServerClient
    from tokenmill.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class Command:
    """One `tokenmill` command: its name and one-line help (what `tokenmill --help` lists
    without importing it), the ``module:function`` that registers its parser, and whether it
    is interactive (quiet logs by default)."""

    name: str
    help: str
    register: str
    interactive: bool = False


# Every `tokenmill` command, in the order `tokenmill --help` lists them: the one place that
# says which commands exist, so no subpackage needs to import this module.
COMMANDS: tuple[Command, ...] = (
    Command("serve", "serve the OpenAI-compatible HTTP API",
            "tokenmill.cli:add_serve_parser"),
    Command("chat", "interactive chat with history (offline, or a server's with --url)",
            "tokenmill.cli:add_chat_parser", interactive=True),
    Command("generate", "generate from a prompt, streaming to the terminal",
            "tokenmill.cli:add_generate_parser", interactive=True),
    Command("pull", "download a model from the Hugging Face hub into the local cache",
            "tokenmill.hub.cli:add_pull_parser", interactive=True),
    Command("list", "the models in the local cache", "tokenmill.hub.cli:add_list_parser",
            interactive=True),
    Command("rm", "remove models from the local cache", "tokenmill.hub.cli:add_rm_parser",
            interactive=True),
    Command("models", "the models of a running server: list (/v1/models); load, unload, swap "
            "(admin API)", "tokenmill.server.admin_cli:add_models_parser", interactive=True),
    Command("info", "print model, device, dtype and the KV memory plan",
            "tokenmill.cli:add_info_parser", interactive=True),
    Command("bench", "benchmarks: load generator, throughput, latency, compare",
            "tokenmill.cli:add_bench_parser"),
    Command("batch", "answer an OpenAI Batch API JSONL file (resumable)",
            "tokenmill.batch.cli:add_batch_parser"),
    Command("stream", "answer records from stdin or a Redis Stream as they arrive",
            "tokenmill.stream.cli:add_stream_parser"),
    Command("monitor", "the drift monitor of a running server",
            "tokenmill.server.monitor_cli:add_monitor_parser"),
    Command("tokenizer", "the model's tokenizer for other tools",
            "tokenmill.cli:add_tokenizer_parser", interactive=True),
)

# `tokenmill bench <suite>`, in the order `tokenmill bench --help` lists them.
BENCH_SUITES: tuple[str, ...] = (
    "tokenmill.bench.serve:add_serve_parser", "tokenmill.bench.throughput:add_throughput_parser",
    "tokenmill.bench.latency:add_latency_parser", "tokenmill.bench.compare:add_compare_parser",
    "tokenmill.bench.prefix_cache:add_prefix_cache_parser",
    "tokenmill.bench.spec:add_spec_parser", "tokenmill.bench.batch:add_batch_bench_parser",
    "tokenmill.bench.gpu:add_gpu_parser", "tokenmill.cli:_add_perplexity_parser",
    "tokenmill.bench.fuzz:add_fuzz_parser", "tokenmill.bench.structured:add_structured_parser",
    "tokenmill.bench.retrieval:add_retrieval_parser", "tokenmill.bench.embed:add_embed_parser",
    "tokenmill.bench.rerank:add_rerank_parser",
    "tokenmill.bench.contention:add_contention_parser", "tokenmill.bench.lora:add_lora_parser",
    "tokenmill.bench.beam:add_beam_parser", "tokenmill.bench.reasoning:add_reasoning_parser",
    "tokenmill.bench.reasoning_stream:add_reasoning_stream_parser",
)

# Registers one sub-command on a subparsers action: its name, help, options, and its handler
# as the `func` default, all of which belong to the module that runs the command.
Registrar = Callable[[argparse._SubParsersAction], None]


def _registrar(target: str) -> Registrar:
    """The function a ``module:function`` string names, imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill serve` (its options: tokenmill.server.serve_cli)."""
    from tokenmill.serve_ray.cli import add_ray_serve_args
    from tokenmill.server.serve_cli import add_serve_parser as add_options

    add_options(subparsers)
    add_ray_serve_args(subparsers.choices["serve"])
    subparsers.choices["serve"].set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run `tokenmill serve` until SIGTERM / SIGINT, the models named on the hub fetched
    first."""
    from tokenmill.serve_ray.cli import run_ray_serve, wants_ray
    from tokenmill.server.serve_cli import merge_model_args, run_serve

    merge_model_args(args)
    fetch_named_models(args)
    if wants_ray(args):  # --replicas / --min-replicas / --max-replicas: on Ray Serve
        return run_ray_serve(args)
    return run_serve(args)


def fetch_named_models(args: argparse.Namespace) -> None:
    """Replace each ``--model`` that names a hub repo by its files in the local cache
    (downloaded first if need be), served under the repo's name unless it has a name of its
    own or --served-model-name gives one (vLLM serves a repo id as its name)."""
    from tokenmill.hub.download import Hub, fetch
    from tokenmill.hub.refs import parse_hub_ref
    from tokenmill.server.model_registry import parse_model_spec

    values, named = [], 0
    for value in args.model or []:
        spec = parse_model_spec(value)
        ref = None
        if spec.path is not None and not os.path.exists(spec.path) and \
                args.load_format != "dummy":
            ref = parse_hub_ref(spec.path, args.revision)
        if ref is None:
            values.append(value)
            continue
        named += 1
        path = fetch(ref, Hub())
        name = spec.name or (None if args.served_model_name else ref.name)
        values.append(",".join([f"{name}={path}" if name else path, *value.split(",")[1:]]))
    if args.revision is not None and not named:
        raise ValueError(f"--revision {args.revision!r} is for a model named on the Hugging "
                         "Face hub (ORG/NAME); no model is")
    args.model = values or args.model


def fetch_model(args: argparse.Namespace) -> None:
    """A --model named on the Hugging Face hub is fetched (or found in the cache) before the
    engine starts, so its progress bar and errors come first; a local path always wins."""
    from tokenmill.hub.download import resolve_model

    if args.model is None or args.load_format == "dummy":
        if args.revision is not None:
            raise ValueError("--revision is for a model named on the Hugging Face hub "
                             "(--model ORG/NAME)")
        return
    args.model = resolve_model(args.model, args.revision)


def _engine(args: argparse.Namespace) -> LLMEngine:
    from tokenmill.engine.args import engine_config_from_args
    from tokenmill.engine.llm_engine import LLMEngine

    fetch_model(args)
    return LLMEngine(engine_config_from_args(args))


def _server(args: argparse.Namespace) -> ServerClient:
    from tokenmill.chat_remote import ServerClient

    return ServerClient(args.url, args.api_key or envs.TOKENMILL_API_KEY,
                        args.model)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run `tokenmill generate`: one prompt, streamed to stdout, then a summary."""
    from tokenmill.engine.args import sampling_params_from_args

    params = sampling_params_from_args(args)
    if args.url:
        from tokenmill.chat_remote import run_generate_remote

        return run_generate_remote(_server(args), args.prompt, params)
    from tokenmill.chat import run_generate

    return run_generate(_engine(args), args.prompt, params)


def cmd_chat(args: argparse.Namespace) -> int:
    """Run `tokenmill chat`: read messages from the terminal until /exit or EOF."""
    from tokenmill.chat import ChatSession, EngineChat
    from tokenmill.engine.args import sampling_params_from_args

    params = sampling_params_from_args(args)
    if args.url:
        from tokenmill.chat_remote import ServerChat

        return ChatSession(ServerChat(_server(args), params), args.system).run()
    return ChatSession(EngineChat(_engine(args), params), args.system).run()


def cmd_info(args: argparse.Namespace) -> int:
    """Run `tokenmill info [MODEL]`: what the model's files say (their headers only: family,
    parameters, how each part is stored, KV bytes per token), then, unless --no-load, the
    engine loaded and what it runs and how."""
    from tokenmill.model_loader import resolve_model_path
    from tokenmill.model_loader.info import summarize

    if args.model_path is not None:
        if args.model:
            raise ValueError(f"the model is given twice: as MODEL ({args.model_path!r}) and as "
                             f"--model {args.model}; give one of them")
        args.model = args.model_path
    fetch_model(args)
    summary = summarize(resolve_model_path(args.model, args.task))
    _print_rows([("model", summary.path), *summary.rows()])
    if args.no_load:
        return 0
    _print_rows(_engine_rows(_engine(args)))
    return 0


def _print_rows(rows: Sequence[tuple[str, str]]) -> None:
    width = 36  # the longest label of both tables, so that they line up
    for k, v in rows:
        print(f"{k:<{width}}  {v}", flush=True)


def _engine_rows(engine: LLMEngine) -> list[tuple[str, str]]:
    """`tokenmill info`'s lines about the loaded engine."""
    import torch

    info = engine.model_info()
    return [
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
        ("decode CUDA graphs", _describe_graphs(info.decode_graph_sizes,
                                                info.decode_graph_max_seq_len)),
        ("max model len", str(info.max_model_len)),
        ("kv cache", info.kv_cache.describe().removeprefix("KV cache: ")),
        ("torch", torch.__version__),
    ]


def _describe_graphs(sizes: Sequence[int], max_seq_len: int | None) -> str:
    if not sizes:
        return "off"
    return (f"batch sizes {sizes[0]}..{sizes[-1]} ({len(sizes)} graphs), "
            f"contexts up to {max_seq_len}")


def _add_model_args(p: argparse.ArgumentParser, remote: bool) -> None:
    """The engine's options (a model named on the hub too); ``remote``: --url and --api-key
    to use a running server's model instead."""
    from tokenmill.engine.args import add_engine_args
    from tokenmill.hub.cli import add_revision_arg

    add_engine_args(p)
    add_revision_arg(p)
    if remote:
        g = p.add_argument_group("a running server (instead of the offline engine)")
        g.add_argument("--url", default=None, metavar="URL",
                       help="talk to the server at URL (http://127.0.0.1:8000) through its "
                       "OpenAI API; --model names its model (default: its first), the engine "
                       "options are unused")
        g.add_argument("--api-key", default=None,
                       help="the server's API key (default: $TOKENMILL_API_KEY)")


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill generate`."""
    from tokenmill.engine.args import add_sampling_args

    p = subparsers.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    p.add_argument("prompt")
    _add_model_args(p, remote=True)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill chat`."""
    from tokenmill.engine.args import add_sampling_args

    p = subparsers.add_parser("chat", help="interactive chat with history")
    p.add_argument("--system", default=None, help="system message")
    _add_model_args(p, remote=True)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)


def add_info_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill info`."""
    p = subparsers.add_parser("info", help="print model, device, dtype and the KV memory plan")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the model (as --model): a GGUF file, a Hugging Face folder or repo")
    p.add_argument("--no-load", action="store_true",
                   help="print only what the model's files say (family, total and active "
                   "parameters, how each part is stored, KV bytes per token), read from their "
                   "headers without loading the weights")
    _add_model_args(p, remote=False)
    p.set_defaults(func=cmd_info)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench` and its suites (`BENCH_SUITES`)."""
    p = subparsers.add_parser("bench", help="benchmarks: load generator, throughput, latency, compare")
    suites = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for target in BENCH_SUITES:
        _registrar(target)(suites)


def _add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench perplexity` from tokenmill/bench/perplexity.py, a separate module.

    A missing module leaves the sub-command out and a broken one only breaks `bench
    perplexity` itself (it then explains the import error), never the other benchmarks.
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


def _version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenmill")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `tokenmill` parser. With ``argv``, only the command it names is built in full (the
    others are listed by name and help, unimported); without, every command is."""
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_log_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if wanted is None or command.name == wanted:
            _registrar(command.register)(sub)
        else:
            sub.add_parser(command.name, help=command.help)
    _accept_global_options(sub)
    return parser


def _add_log_options(p: argparse.ArgumentParser, default: object) -> None:
    """-q and -v; ``default`` None: the top level's (False), else SUPPRESS (a command's: the
    value given before its name stays)."""
    quiet = {} if default is None else {"default": default}
    if "--quiet" not in p._option_string_actions:
        p.add_argument("-q", "--quiet", action="store_true", help="log warnings only", **quiet)
    if "--verbose" not in p._option_string_actions:
        p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO) too, "
                       "also for the interactive commands (chat, generate, pull...)", **quiet)


def _accept_global_options(sub: argparse._SubParsersAction) -> None:
    """Let every command (and sub-command) take the global options after its name too:
    `tokenmill chat -q` as well as `tokenmill -q chat`; and refuse abbreviated options
    (`--admin` is not `--admin-key`) everywhere."""
    for p in sub.choices.values():
        p.allow_abbrev = False
        _add_log_options(p, argparse.SUPPRESS)
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


def _log_level(args: argparse.Namespace) -> int:
    """WARNING with -q; INFO with -v; else the command's own: warnings only for interactive
    commands (their output is the point), progress for servers and jobs."""
    if args.quiet:
        return logging.WARNING
    interactive = any(c.interactive for c in COMMANDS if c.name == args.command)
    return logging.WARNING if interactive and not args.verbose else logging.INFO


def main(argv: list[str] | None = None) -> int:
    """The `tokenmill` entry point: parse, set up logging, run the command; 2 on a user error."""
    # Before any command's modules load torch (and with it OpenMP, which reads it then).
    envs.default_thread_policy()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=_log_level(args), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # a line per HTTP request (huggingface_hub's too)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
