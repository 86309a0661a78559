"""`tokenmill serve`'s options, grouped as `tokenmill serve --help` shows them (model, engine,
server, security, operations), and the server they start. (tokenmill.cli registers the command:
it fetches models named on the Hugging Face hub first, which the server layer does not do.)"""

from __future__ import annotations

import argparse

from tokenmill import envs
from tokenmill.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig
from tokenmill.engine.args import add_engine_args, add_lora_modules_arg
from tokenmill.tenancy.retention import DEFAULT_USAGE_RETENTION_DAYS, TenancySettings

# `tokenmill serve --help`'s groups, in order, with the options each takes from the groups
# they were added to; an option named nowhere stays in its first group's place: engine options
# under "engine", server options under "server", the drift monitor's under "operations".
SERVE_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model_path", "model", "revision", "served_model_name", "dtype", "quantization",
              "load_format", "task", "pooling", "max_model_len", "speculative",
              "speculative_model", "num_speculative_tokens", "ngram_min", "ngram_max",
              "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules"),
    "engine": (),
    "server": (),
    "security": ("api_key", "admin_key", "auth_health_metrics", "allowed_hosts",
                 "allowed_origins", "allow_runtime_lora_updating", "max_body_bytes",
                 "max_upload_bytes", "header_timeout", "body_timeout", "max_connections"),
    "operations": ("max_queue", "drain_timeout", "log_stats_interval", "cost_per_hour",
                   "cpu_watts", "usage_retention_days", "debug_fail_at_step"),
}
# Where the options of the groups the adders made go when SERVE_GROUPS does not name them.
_FALLBACK = {"engine": "engine", "server": "server"}


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill serve`."""
    from tokenmill.server.monitor_cli import add_monitor_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve models over the OpenAI (and Ollama) HTTP API.")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as `vllm serve MODEL` takes it: a GGUF file or "
                   "Hugging Face folder, or a Hugging Face repo (ORG/NAME, ORG/NAME:QUANT, "
                   "ORG/NAME/FILE.gguf, @REVISION) fetched into the local cache; the same as "
                   "one --model [NAME=]MODEL[,OPT] (default: the embedded models)")
    add_engine_args(p, several_models=True)
    p.add_argument("--revision", default=None, metavar="REV", help="the branch, tag or "
                   "commit of the models named on the hub (the same as MODEL@REVISION; "
                   "default: main)")
    add_serve_args(p)
    add_monitor_args(p)
    regroup(p, SERVE_GROUPS)
    p.set_defaults(func=run_serve)


def regroup(p: argparse.ArgumentParser, layout: dict[str, tuple[str, ...]]) -> None:
    """Put ``p``'s options in the groups of ``layout`` (in its order) for --help; options
    it does not name go to their old group's namesake in ``_FALLBACK``, else to the last."""
    old = [g for g in p._action_groups if g not in (p._positionals, p._optionals)]
    where = {dest: title for title, dests in layout.items() for dest in dests}
    moving: list[tuple[argparse.Action, str | None]] = []
    for default in (p._positionals, p._optionals):  # MODEL, --revision
        moving += [(a, None) for a in default._group_actions if a.dest in where]
        default._group_actions[:] = [a for a in default._group_actions if a.dest not in where]
    moving += [(a, g.title) for g in old for a in g._group_actions]
    for g in old:
        p._action_groups.remove(g)
    groups = {title: p.add_argument_group(title) for title in layout}
    last = list(layout)[-1]
    for action, title in moving:
        target = where.get(action.dest) or _FALLBACK.get(title or "", last)
        groups[target]._group_actions.append(action)
    for title, group in groups.items():  # the named options first, in the layout's order
        order = {dest: i for i, dest in enumerate(layout[title])}
        group._group_actions.sort(key=lambda a: order.get(a.dest, len(order)))


def merge_model_args(args: argparse.Namespace) -> None:
    """MODEL is one --model; ValueError when both are given."""
    if args.model_path is not None:
        if args.model:
            raise ValueError(f"the model is given twice: as MODEL ({args.model_path!r}) and as "
                             f"--model {args.model}; give one of them")
        args.model = [args.model_path]
        args.model_path = None


def run_serve(args: argparse.Namespace) -> int:
    """Serve the models of ``args`` (paths on disk by now) until SIGTERM / SIGINT."""
    from tokenmill.engine.args import parse_lora_module
    from tokenmill.server.launcher import run_server
    from tokenmill.server.model_registry import config_factory, served_models

    merge_model_args(args)
    config = server_config_from_args(args)
    lora_modules = [parse_lora_module(v) for v in args.lora_modules]
    tenancy = TenancySettings(usage_retention_days=args.usage_retention_days)
    return run_server(served_models(args), config, config_factory(args), lora_modules,
                      tenancy)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of `tokenmill serve`'s options."""
    from tokenmill.server.monitor_cli import monitor_config_from_args

    return ServerConfig(
        served_model_name=args.served_model_name, host=args.host, port=args.port,
        api_key=args.api_key or envs.TOKENMILL_API_KEY,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout, auth_health_metrics=args.auth_health_metrics,
        debug_fail_at_step=args.debug_fail_at_step, allowed_hosts=_names(args.allowed_hosts),
        allowed_origins=_names(args.allowed_origins), header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, max_connections=args.max_connections,
        split_special_tokens=args.split_special_tokens, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, max_thinking_tokens=args.max_thinking_tokens,
        admin_key=args.admin_key or envs.TOKENMILL_ADMIN_KEY,
        models_dir=args.models_dir, max_loaded_models=args.max_loaded_models,
        keep_alive=args.keep_alive if args.keep_alive > 0 else None,
        log_stats_interval=args.log_stats_interval, webui=args.webui,
        data_dir=args.data_dir, max_upload_bytes=args.max_upload_bytes,
        audit_log_content=args.audit_log_content,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        monitor=monitor_config_from_args(args))


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
                   "on-demand model is unloaded to make room (default: the models given at "
                   "start plus one per 8 GiB of memory, 1 to 3)")
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
                   help="the name clients send as `model` (default: the repo's name for a "
                   "model named on the hub, else the model file's name)")
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
                   "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]), qwen3_coder "
                   "(<function=...>: Qwen3-Coder), pythonic ([f(x=1)]: Llama 3.2/4), gpt_oss "
                   "(harmony's commentary calls), or auto (by the chat template)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   default=ServerConfig.reasoning_parser,
                   help="split a reasoning model's thinking from its answer (into "
                   "reasoning_content): qwen3 or deepseek_r1 (<think>...</think>), gpt_oss "
                   "(harmony's analysis channel), auto (by the chat template) or none (the "
                   "thinking stays in the content)")
    g.add_argument("--max-thinking-tokens", type=int, default=None, metavar="N",
                   help="the thinking budget of a request that sets none: after N thinking "
                   "tokens the model is made to end its thinking and answer (default: "
                   "unbounded)")
    add_lora_modules_arg(g, "a request names one as its model (base_model_name picks the "
                         "model it runs on; default: the first text-generation model)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind "
                   "the admin key if there is one, else the API key); needs --enable-lora")
    g.add_argument("--data-dir", default=None,
                   help="folder of uploaded files and vector stores (default: tokenmill's "
                   "folder in the user's data directory)")
    g.add_argument("--audit-log-content", action="store_true",
                   help="with --admin-key: keep each project request's prompt and answer text "
                   "in its audit record (default: counts, cost and timing only)")
    g.add_argument("--usage-retention-days", type=float,
                   default=DEFAULT_USAGE_RETENTION_DAYS, metavar="DAYS",
                   help="with --admin-key: delete the projects' usage rows older than this, at "
                   "start and hourly (0: keep them forever; the current month's always stay, "
                   "for the budgets)")
    g.add_argument("--max-upload-bytes", type=int, default=ServerConfig.max_upload_bytes,
                   help="larger files sent to /v1/files get 413")
    g.add_argument("--debug-fail-at-step", type=int, default=None, metavar="N",
                   help="TESTING ONLY: make the N-th engine step raise (fault injection)")
