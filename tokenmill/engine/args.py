"""Command-line options of an engine and of its sampling, shared by every command that starts one.

`tokenmill serve|generate|chat|info`, the batch and stream jobs and the offline benchmarks all
add these groups to their parsers. The engine's flags, help, choices and defaults are derived
from ``tokenmill.config``'s dataclass fields (``tokenmill.options``), as are ``LLM()``'s
keywords, so the command line and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.lora_request import LoRARequest
from tokenmill.options import Option, add_arguments, build, canonical_keywords, options_of
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

# Every engine option, read from the config dataclasses' fields: the flags of
# `add_engine_args` and the keywords of `LLM()` and `engine_config`.
ENGINE_OPTIONS: tuple[Option, ...] = tuple(options_of(EngineConfig))

# The CLI's sampling defaults: a chat-like temperature and room for a paragraph, where
# SamplingParams' own defaults (temperature 1, 16 tokens) follow the OpenAI API.
CLI_MAX_TOKENS = 256
CLI_TEMPERATURE = 0.7


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Options shared by every command that starts an engine, one per option of
    ``EngineConfig``; ``several_models``: --model may be repeated, as
    ``[NAME=]PATH[,option...]`` (see tokenmill.server.model_registry)."""
    g = p.add_argument_group("engine")
    if several_models:
        g.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH[,OPT]",
                       help="a model to serve (repeatable): GGUF file or Hugging Face folder, "
                            "or a Hugging Face repo (ORG/NAME[:QUANT]), "
                            "with the name clients use and engine options of its own, e.g. "
                            "chat=model.gguf,max-model-len=4096 (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    add_arguments(g, [o for o in ENGINE_OPTIONS if not (several_models and o.name == "model")])
    # The short spelling the help names, beside BooleanOptionalAction's --no-enable-prefix-caching.
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)


def engine_config(options: Mapping[str, object], where: str = "engine_config()") -> EngineConfig:
    """The EngineConfig of engine options by name (the flags' names with underscores; an
    option left out keeps its default); TypeError naming an unknown option (under ``where``),
    ValueError (from the config classes) naming a bad value."""
    return build(EngineConfig, canonical_keywords(options, ENGINE_OPTIONS, where))


_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True)
class LoRAModule:
    """An adapter to serve: the name clients send as ``model``, its PEFT folder, and the
    served model it runs on (None: the first text-generation model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """One ``--lora-modules`` value: ``NAME=PATH`` or a JSON object with ``name``, ``path``
    and optionally ``base_model_name``; ValueError naming what is wrong."""
    where = f"--lora-modules {value!r}"
    text = value.strip()
    if not text.startswith("{"):
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{where}: expected NAME=PATH or a JSON object with name and path")
        fields: dict[str, object] = {"name": name.strip(), "path": path.strip()}
    else:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: expected a JSON object")
        unknown = sorted(set(fields) - _MODULE_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: name, path, "
                             "base_model_name)")
    for key in ("name", "path"):
        if not isinstance(fields.get(key), str) or not fields[key]:
            raise ValueError(f"{where}: {key} must be a non-empty string")
    base = fields.get("base_model_name")
    if base is not None and (not isinstance(base, str) or not base):
        raise ValueError(f"{where}: base_model_name must be a non-empty string")
    return LoRAModule(str(fields["name"]), str(fields["path"]), base)


def add_lora_modules_arg(g: argparse._ArgumentGroup, what: str) -> None:
    """``--lora-modules`` of `serve` and `batch` (parsed by :func:`parse_lora_module`);
    ``what`` says where the adapters run."""
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="LoRA adapters (PEFT folders), each under its own "
                   "model name: NAME=PATH, or a JSON object {\"name\", \"path\", "
                   f"\"base_model_name\"}}; {what}; needs --enable-lora")


def job_adapters(values: list[str], config: EngineConfig) -> dict[str, LoRARequest]:
    """The ``--lora-modules`` values of a one-model job (batch, stream) by name, each with an
    id of its own (every adapter runs on the job's model, whatever ``base_model_name`` says);
    ValueError for a bad value, a repeated name, or adapters without ``--enable-lora``."""
    modules = [parse_lora_module(v) for v in values]
    if modules and not config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    adapters: dict[str, LoRARequest] = {}
    for i, module in enumerate(modules, start=1):
        if module.name in adapters:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        adapters[module.name] = LoRARequest(module.name, i, module.path)
    return adapters


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the options that `add_engine_args` added."""
    return build(EngineConfig, {o.name: getattr(args, o.name) for o in ENGINE_OPTIONS})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling options of the commands that generate text (generate, chat, stream)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS, help="output tokens at most")
    g.add_argument("--temperature", type=float, default=CLI_TEMPERATURE, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p, help="nucleus sampling: the smallest set of tokens with this much probability")
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k, help="sample among the k most likely tokens (-1 or 0: all)")
    g.add_argument("--min-p", type=float, default=SamplingParams.min_p, help="drop tokens less likely than this share of the most likely one")
    g.add_argument("--repetition-penalty", type=float, default=SamplingParams.repetition_penalty, help="divide the logits of tokens already seen by this (1: off)")
    g.add_argument("--sampling-seed", type=int, default=SamplingParams.seed, help="seed of the sampler (default: random)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the output is JSON matching this schema (JSON text, or @file)")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", default=None, help="the output matches this regular expression")
    s.add_argument("--choice", action="append", default=None,
                   help="the output is one of these strings (repeatable)")
    s.add_argument("--grammar", default=None, metavar="EBNF",
                   help="the output matches this EBNF grammar (text, or @file)")


def _text_or_file(value: str | None) -> str | None:
    """``@path`` reads the file; anything else is the text itself."""
    if value is None or not value.startswith("@"):
        return value
    with open(value[1:], encoding="utf-8") as f:
        return f.read()


def structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The output constraint the sampling options ask for, if any."""
    fields = {"json": _text_or_file(args.json_schema), "regex": args.regex,
              "choice": args.choice, "grammar": _text_or_file(args.grammar),
              "json_object": args.json_object}
    if not any(fields.values()):
        return None
    return StructuredOutputsParams(**{k: v for k, v in fields.items() if v})


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of the options that `add_sampling_args` added."""
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=args.stop,
        structured_outputs=structured_outputs_from_args(args))
