"""Several models in one server: `--model NAME=PATH[,option...]` specs, one EngineConfig per
model, and one KV-cache budget shared among them.

Each served model has its own engine (scheduler, KV cache, weights). Engine options given once
on the command line apply to every model; options after the path apply to that model only and
use the same names without the dashes, e.g.

    tokenmill serve --model chat=model.gguf,max-model-len=4096 --model small=other.gguf,int8

(a bare word is a flag: ``no-prefix-caching``, ``deterministic``; the quantization names are a
short form of ``quantization=...``). Paths with commas cannot be given this way. Only the
engine's own option names are taken, spelt out (no abbreviations: ``mode=`` is no ``model=``);
the admin API takes the same names, and checks the path-valued ones (``PATH_OPTIONS``) against
--models-dir.

Memory: with several models the KV budget is one: ``--kv-cache-memory`` bytes if given, else
``--kv-cache-memory-fraction`` of the memory free before loading (capped on the CPU as for one
model), split among the models in proportion to their ``kv-share`` (default 1 each): an explicit
total is each model's size, a default one is the most each model's default size may take (a
small model takes less; models loaded later, on demand, share what is left). A model
with its own ``kv-cache-memory`` or ``num-kv-blocks`` keeps exactly that, outside the split. On
CUDA the split is of what ``--gpu-memory-utilization`` leaves: the models load one after
another and each takes its share of what is left for the models still to load.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.config import QUANTIZATIONS, EngineConfig
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.engine.device import CPU_DEFAULT_KV_BYTES_CAP, EngineDevice

# Hugging Face model types that are encoders (they keep no KV cache).
ENCODER_MODEL_TYPES = frozenset({"bert"})
# Per-model options that are not engine options.
_SHARE = "kv-share"
# Engine options a model may not set for itself: they are one per server (the kernels' spin
# time is a setting of the process).
_SERVER_WIDE = {"device", "num-threads", "threads", "tensor-parallel-size", "kernel-spin-us"}
# Per-model options whose value is a file or folder (a server with --models-dir keeps them
# inside it); "self:N" (the target's own first layers) is no path.
PATH_OPTIONS = frozenset({"speculative-model"})


@dataclass(frozen=True)
class ModelSpec:
    """One `--model` value: the name clients use (None: from the path), the path (None: the
    embedded default), the per-model engine flags and its share of the KV budget."""

    name: str | None
    path: str | None
    flags: tuple[str, ...] = ()
    kv_share: float = 1.0
    # False for an encoder (it keeps no KV cache): it takes no share of the budget.
    needs_kv_cache: bool = True

    @property
    def own_kv_size(self) -> bool:
        """Whether the model sets its KV cache size itself (outside the shared budget)."""
        own = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--num-kv-blocks")
        return any(f.partition("=")[0] in own for f in self.flags)

    def with_paths(self, resolve: Callable[[str, str], str]) -> ModelSpec:
        """This spec with the value of each path-valued option replaced by
        ``resolve(value, option)`` (which may refuse it)."""
        flags = []
        for flag in self.flags:
            key, sep, value = flag.partition("=")
            if sep and key[2:] in PATH_OPTIONS and not value.startswith("self:"):
                flag = f"{key}={resolve(value, key[2:])}"
            flags.append(flag)
        return dataclasses.replace(self, flags=tuple(flags))


@functools.cache
def model_options() -> frozenset[str]:
    """The option names a model may set for itself: the engine's options (without dashes,
    spelt out), less the server-wide ones and ``model`` (the spec's path)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    names = {o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")}
    return frozenset(names - _SERVER_WIDE - {"model"})


def parse_model_spec(value: str) -> ModelSpec:
    """``[NAME=]PATH[,option[=value]...]``; ValueError naming what is wrong."""
    head, *options = value.split(",")
    name: str | None = None
    path = head
    if "=" in head and not os.path.exists(head):
        name, path = head.split("=", 1)
        if not name.strip():
            raise ValueError(f"--model {value!r}: the name before '=' is empty")
        name = name.strip()
    if not path.strip():
        raise ValueError(f"--model {value!r}: the path is empty")
    flags: list[str] = []
    share = 1.0
    for option in options:
        key, _, arg = option.strip().partition("=")
        key = key.strip().replace("_", "-")
        if not key:
            continue
        if key == _SHARE:
            try:
                share = float(arg)
            except ValueError:
                raise ValueError(f"--model {value!r}: kv-share must be a number") from None
            if not share > 0:
                raise ValueError(f"--model {value!r}: kv-share must be > 0, got {arg}")
        elif key in QUANTIZATIONS and not arg:
            flags.append(f"--quantization={key}")
        elif key in _SERVER_WIDE or key == "model":
            raise ValueError(f"--model {value!r}: {key} is one per server, not per model")
        elif key not in model_options():
            raise ValueError(f"--model {value!r}: unknown option {key!r} (the engine's "
                             "options, spelt out without the dashes: max-model-len=2048, "
                             "int8, no-prefix-caching, ...)")
        else:
            # One token, so that no value is ever read as an option of its own.
            flags.append(f"--{key}={arg}" if arg else f"--{key}")
    path = path.strip()
    return ModelSpec(name, path, tuple(flags), share, needs_kv_cache=not _is_encoder(path))


def _is_encoder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face folder of an encoder (BERT family: no KV cache)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in ENCODER_MODEL_TYPES


class _SpecParser(argparse.ArgumentParser):
    """Engine options of one spec: errors raise instead of exiting; no abbreviations (a
    request's ``mode`` must not become ``--model``)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(allow_abbrev=False, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def engine_configs(args: argparse.Namespace, specs: list[ModelSpec]) -> list[EngineConfig]:
    """Each spec's EngineConfig: the command line's engine options, then the spec's own."""
    parser = _SpecParser(prog="--model", add_help=False)
    add_engine_args(parser)
    parser.set_defaults(**{k: v for k, v in vars(args).items() if k != "model"})
    configs = []
    for spec in specs:
        argv = ["--model", spec.path] if spec.path else []
        try:
            ns = parser.parse_args([*argv, *spec.flags])
        except ValueError as e:
            raise ValueError(f"--model {spec.name or spec.path}: {e}") from None
        config = engine_config_from_args(ns)
        if config.lora.enable_lora and "--enable-lora" not in spec.flags and _embeds(spec,
                                                                                    config):
            # The command line's --enable-lora is for the models that generate text (the
            # default server's embedding model among them would refuse it).
            config = dataclasses.replace(
                config, lora=dataclasses.replace(config.lora, enable_lora=False))
        configs.append(config)
    return configs


def _embeds(spec: ModelSpec, config: EngineConfig) -> bool:
    """Whether the model computes embeddings (task embed, or an encoder's folder)."""
    return (config.model.task == "embed" or not spec.needs_kv_cache
            or (spec.path is not None and _is_encoder(spec.path)))


def share_kv_budget(configs: list[EngineConfig], specs: list[ModelSpec],
                    budget_bytes: int | None, free_memory: int,
                    on_cuda: bool) -> list[EngineConfig]:
    """``configs`` with their KV sizes taken from one budget (see the module's docstring):
    ``budget_bytes`` (the command line's --kv-cache-memory) if given; else on the CPU the
    first config's kv_cache_memory_fraction of ``free_memory`` (bytes free before any model
    loads, capped); else (CUDA) each model's share of what gpu_memory_utilization leaves."""
    if len(configs) < 2:
        return configs
    splitting = [i for i, s in enumerate(specs) if not s.own_kv_size and s.needs_kv_cache]
    if not splitting:
        return configs
    total_share = sum(specs[i].kv_share for i in splitting)
    out = list(configs)
    if budget_bytes is None and on_cuda:
        # Loaded in order: each takes its share of what the models after it have not used.
        left = total_share
        for i in splitting:
            cache = dataclasses.replace(out[i].cache, kv_cache_memory_bytes=None,
                                        kv_cache_share=specs[i].kv_share / left)
            out[i] = dataclasses.replace(out[i], cache=cache)
            left -= specs[i].kv_share
        return out
    # An explicit total is split as it is; a default one caps each model's default size, which
    # stays what its workload and weights make sensible (see runner/kv_memory.py).
    field = "kv_cache_memory_bytes" if budget_bytes is not None else "kv_cache_max_bytes"
    if budget_bytes is None:
        budget_bytes = default_server_kv_budget(configs[0].cache.kv_cache_memory_fraction,
                                                free_memory)
    for i in splitting:
        share = max(int(budget_bytes * specs[i].kv_share / total_share), 1)
        cache = dataclasses.replace(out[i].cache, **{field: share})
        out[i] = dataclasses.replace(out[i], cache=cache)
    return out


def default_server_kv_budget(fraction: float, free_memory: int) -> int:
    """The KV bytes a CPU server gives all its models together without --kv-cache-memory:
    ``fraction`` (--kv-cache-memory-fraction) of the memory free before any model loads,
    capped."""
    return min(int(free_memory * fraction), CPU_DEFAULT_KV_BYTES_CAP)


def default_specs(args: argparse.Namespace | None = None) -> list[ModelSpec]:
    """What `tokenmill serve` serves without --model: the embedded chat model and the embedded
    embedding model (all-MiniLM-L6-v2, no KV cache); with --task embed only the latter."""
    embed = ModelSpec(None, None, ("--task", "embed"), needs_kv_cache=False)
    if args is not None and getattr(args, "task", None) == "embed":
        return [embed]
    return [ModelSpec(None, None, ("--task", "generate")), embed]


def served_models(args: argparse.Namespace) -> list[tuple[str | None, EngineConfig]]:
    """`tokenmill serve`'s models as (name or None, EngineConfig), the KV budget shared."""
    specs = [parse_model_spec(v) for v in args.model] if args.model else default_specs(args)
    configs = engine_configs(args, specs)
    if len(configs) > 1:
        platform = EngineDevice(configs[0].device.device)
        configs = share_kv_budget(configs, specs, args.kv_cache_memory_bytes,
                                  platform.available_memory(), platform.is_cuda)
    return [(spec.name, c) for spec, c in zip(specs, configs, strict=True)]


@dataclass(frozen=True)
class LoadBudget:
    """What the models loaded while serving share: ``kv_bytes`` of KV cache in all (None: each
    sizes its own, as on CUDA or with --kv-cache-memory) and ``free_memory``, which says how
    much host memory is free now (None: not checked, as on CUDA)."""

    kv_bytes: int | None = None
    free_memory: Callable[[], int] | None = None


@dataclass(frozen=True)
class ModelFactory:
    """The EngineConfig of a model loaded later (admin API, on demand): the command line's
    options, then the spec's own; and the budget such models share."""

    args: argparse.Namespace
    budget: LoadBudget = LoadBudget()

    def __call__(self, spec: ModelSpec) -> EngineConfig:
        return engine_configs(self.args, [spec])[0]


def config_factory(args: argparse.Namespace) -> ModelFactory:
    """The factory of models loaded later; call it before the first model loads: the default
    KV budget is a share of the memory free then."""
    platform = EngineDevice(args.device)
    if platform.is_cuda:
        return ModelFactory(args)
    kv_bytes = None
    if args.kv_cache_memory_bytes is None:
        kv_bytes = default_server_kv_budget(args.kv_cache_memory_fraction,
                                            platform.available_memory())
    return ModelFactory(args, LoadBudget(kv_bytes, platform.available_memory))
