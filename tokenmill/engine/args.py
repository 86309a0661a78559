"""Command-line options of an engine and of its sampling, shared by every command that starts one.

`tokenmill serve|generate|chat|info`, the batch and stream jobs and the offline benchmarks all
add these groups to their parsers; the choices and defaults come from ``tokenmill.config``'s
constants and dataclass defaults, so the command line and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from tokenmill.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POOLING_METHODS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    TASKS,
    CacheConfig,
    DeviceConfig,
    EconomicsConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

# The CLI's sampling defaults: a chat-like temperature and room for a paragraph, where
# SamplingParams' own defaults (temperature 1, 16 tokens) follow the OpenAI API.
CLI_MAX_TOKENS = 256
CLI_TEMPERATURE = 0.7


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Options shared by every command that starts an engine; ``several_models``: --model may
    be repeated, as ``[NAME=]PATH[,option...]`` (see tokenmill.server.model_registry)."""
    g = p.add_argument_group("engine")
    if several_models:
        g.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH[,OPT]",
                       help="a model to serve (repeatable): GGUF file or Hugging Face folder, "
                            "or a Hugging Face repo (ORG/NAME[:QUANT]), "
                            "with the name clients use and engine options of its own, e.g. "
                            "chat=model.gguf,max-model-len=4096 (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    else:
        g.add_argument("--model", default=ModelConfig.model,
                       help="GGUF file or Hugging Face folder, or a Hugging Face repo "
                            "(ORG/NAME, ORG/NAME:QUANT, ORG/NAME/FILE.gguf) fetched into the "
                            "local cache (default: embedded "
                            "SmolLM2-135M-Instruct); with --load-format dummy also a preset: "
                            "llama-3.1-8b, qwen3-0.6b")
    g.add_argument("--dtype", default=ModelConfig.dtype, choices=DTYPES, help="compute dtype (auto: float32 on the CPU, bfloat16/float16 on CUDA)")
    g.add_argument("--max-model-len", type=int, default=ModelConfig.max_model_len, help="longest prompt + output in tokens (default: the model's context)")
    g.add_argument("--load-format", default=ModelConfig.load_format, choices=LOAD_FORMATS, help="how to read the weights (auto: by the file; dummy: random, for tests)")
    g.add_argument("--quantization", default=ModelConfig.quantization,
                   choices=QUANTIZATIONS,
                   help="int8 per channel or int4 in groups of 32 (weight-only), fp8 (e4m3 "
                        "weights and per-token activations); auto keeps a GGUF file's Q4 (int4) "
                        "or Q5-Q8 (int8) weights compact on the CPU and is none otherwise")
    g.add_argument("--task", default=ModelConfig.task, choices=TASKS,
                   help="generate text, or embed (pooled embeddings; the default for encoder "
                        "models such as BERT; without --model: the embedded all-MiniLM-L6-v2)")
    g.add_argument("--pooling", default=ModelConfig.pooling, choices=POOLING_METHODS,
                   help="how an embedding pools token states (default: the folder's "
                        "sentence-transformers config, else cls for encoders, last for decoders)")
    g.add_argument("--device", default=DeviceConfig.device, help="cpu, cuda or cuda:N (default: cuda when there is one, else cpu)")
    g.add_argument("--threads", type=int, default=DeviceConfig.num_threads,
                   help="CPU threads per process (default: all cores, shared among the ranks)")
    g.add_argument("--kernel-spin-us", type=int, default=DeviceConfig.kernel_spin_us,
                   metavar="US",
                   help="CPU: how long the C++ kernels' worker threads spin for the next call "
                        "before they sleep (default 200; 0: never spin, for a machine shared "
                        "with busy neighbours); they stop spinning by themselves while their "
                        "core is contended")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=ParallelConfig.tensor_parallel_size, metavar="N",
                   help="shard the model over N GPUs (or N CPU processes)")
    _add_cache_args(g)
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs, help="sequences in one engine step at most (the running batch)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens, help="tokens in one engine step at most (chunked prefill's budget)")
    g.add_argument("--prefill-first", action=argparse.BooleanOptionalAction,
                   default=SchedulerConfig.prefill_first,
                   help="prompts that fit in one step go before the running decodes, which "
                        "take the budget left (a burst of arrivals holds the streams once, "
                        "not at every step); --no-prefill-first: decodes first in every step")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=SchedulerConfig.async_scheduling,
                   help="schedule and launch the next step while the last one runs on the "
                        "device (default: on for one CUDA process without speculative "
                        "decoding, off on the CPU)")
    g.add_argument("--seed", type=int, default=ModelConfig.seed, help="random seed")
    g.add_argument("--deterministic", action="store_true", default=EngineConfig.deterministic,
                   help="batch-invariant greedy decoding on the CPU: a request's tokens do not "
                        "depend on the requests beside it (slower prefill)")
    _add_speculative_args(g)
    _add_lora_args(g)
    g.add_argument("--cost-per-hour", type=float, default=EconomicsConfig.cost_per_hour,
                   metavar="USD", help="the machine's price per hour, spread over the requests "
                   "by compute share (usage.cost_usd, /metrics)")
    g.add_argument("--cpu-watts", type=float, default=EconomicsConfig.cpu_watts, metavar="W",
                   help="power of this process's cores when busy, for the energy estimate where "
                   "the CPU has no readable energy counter (default: 6 W per core)")


def _add_cache_args(g: argparse._ArgumentGroup) -> None:
    """The KV cache's size and layout, and CUDA graphs (which are sized like the cache)."""
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV cache block")
    g.add_argument("--num-kv-blocks", type=int, default=CacheConfig.num_blocks, help="KV cache blocks (overrides the memory options)")
    g.add_argument("--kv-cache-memory", type=int, default=CacheConfig.kv_cache_memory_bytes,
                   metavar="BYTES", help="bytes of KV cache (default: sized from free memory and the workload)")
    g.add_argument("--kv-cache-memory-fraction", type=float,
                   default=CacheConfig.kv_cache_memory_fraction,
                   help="share of free memory for the KV cache (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=CacheConfig.gpu_memory_utilization,
                   help="share of the GPU's total memory the engine may use, weights included; "
                        "the KV cache gets the rest after a profiling step (CUDA)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=CacheConfig.kv_cache_dtype,
                   help="how K and V are stored (auto: the model's dtype; fp16 for a quantized "
                        "model on the CPU; fp8: e4m3 on CUDA GPUs of compute capability >= 8.9, "
                        "half the memory and reads of bf16)")
    g.add_argument("--enforce-eager", action="store_true", default=DeviceConfig.enforce_eager,
                   help="no CUDA graphs: run every decode step eagerly (CUDA)")
    g.add_argument("--cuda-graph-max-batch-size", type=int,
                   default=DeviceConfig.cuda_graph_max_batch_size,
                   help="largest decode batch replayed from a CUDA graph (default: "
                        "--max-num-seqs)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=CacheConfig.enable_prefix_caching,
                   help="reuse the KV cache of shared prompt prefixes (--no-prefix-caching: off)")
    g.add_argument("--kv-events-endpoint", default=CacheConfig.kv_events_endpoint,
                   metavar="ZMQ_ENDPOINT",
                   help="publish the prefix cache's changes (vLLM's KV events: BlockStored, "
                        "BlockRemoved, AllBlocksCleared; msgpack over ZeroMQ PUB) on this "
                        "endpoint, e.g. tcp://*:5557, for KV-aware routers (needs pyzmq and "
                        "msgpack: pip install tokenmill[ray])")
    # The short spelling the help names, beside BooleanOptionalAction's --no-enable-prefix-caching.
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)


def _add_speculative_args(g: argparse._ArgumentGroup) -> None:
    """Speculative decoding: the method, the draft model and how many tokens to propose."""
    g.add_argument("--speculative", default=SpeculativeConfig.method,
                   choices=SPECULATIVE_METHODS,
                   help="speculative decoding: ngram (prompt lookup) or draft (needs "
                        "--speculative-model)")
    g.add_argument("--speculative-model", default=SpeculativeConfig.draft_model, metavar="PATH",
                   help="draft model with the target's tokenizer, or self:N for the target's "
                        "first N layers (implies --speculative draft)")
    g.add_argument("--num-speculative-tokens", type=int,
                   default=SpeculativeConfig.num_speculative_tokens,
                   help="draft tokens verified per step")
    g.add_argument("--ngram-min", type=int, default=SpeculativeConfig.ngram_min,
                   help="shortest n-gram prompt lookup uses")
    g.add_argument("--ngram-max", type=int, default=SpeculativeConfig.ngram_max,
                   help="longest n-gram prompt lookup uses")


def _add_lora_args(g: argparse._ArgumentGroup) -> None:
    """LoRA adapters on the base model (vLLM's options)."""
    g.add_argument("--enable-lora", action="store_true", default=LoRAConfig.enable_lora,
                   help="serve LoRA adapters (PEFT folders) on top of the model")
    g.add_argument("--max-loras", type=int, default=LoRAConfig.max_loras,
                   help="adapters one step may run (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank,
                   help="highest adapter rank that loads")
    g.add_argument("--max-cpu-loras", type=int, default=LoRAConfig.max_cpu_loras,
                   help="adapters kept in host memory (default: 4 x --max-loras)")


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
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          load_format=args.load_format, seed=args.seed,
                          quantization=args.quantization, task=args.task,
                          pooling=args.pooling),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_events_endpoint=getattr(args, "kv_events_endpoint", None)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  prefill_first=args.prefill_first,
                                  async_scheduling=args.async_scheduling),
        device=DeviceConfig(device=args.device, num_threads=args.threads,
                            kernel_spin_us=args.kernel_spin_us,
                            enforce_eager=args.enforce_eager,
                            cuda_graph_max_batch_size=args.cuda_graph_max_batch_size),
        speculative=SpeculativeConfig.from_options(
            args.speculative, args.speculative_model,
            num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
            ngram_max=args.ngram_max),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        deterministic=args.deterministic,
        economics=EconomicsConfig(cost_per_hour=args.cost_per_hour, cpu_watts=args.cpu_watts),
        lora=LoRAConfig(enable_lora=args.enable_lora, max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras),
    )


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
