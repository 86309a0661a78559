"""`tokenmill batch`: an OpenAI Batch API JSONL file through the engine, resumable, on one
process or on Ray Data actors."""

from __future__ import annotations

import argparse
import sys

from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.engine.args import (
    add_engine_args,
    add_lora_modules_arg,
    engine_config_from_args,
    job_adapters,
)
from tokenmill.utils import freeze_startup_heap


def add_batch_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill batch`."""
    p = subparsers.add_parser(
        "batch", help="answer an OpenAI Batch API JSONL file (resumable)",
        description="Answer every line of an OpenAI Batch API input file ({custom_id, method, "
                    "url: /v1/chat/completions | /v1/completions, body}) into a results file. "
                    "Answers are appended as they finish: run the same command again after a "
                    "crash and it finishes the rest.")
    p.add_argument("-i", "--input", required=True, help="input JSONL file")
    p.add_argument("-o", "--output", required=True, help="results JSONL file (appended to)")
    p.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                   help="requests queued in the engine at once (per engine)")
    p.add_argument("--served-model-name", default=None,
                   help="`model` in the response bodies (default: the model file's name)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g = p.add_argument_group("ray", "scale out on Ray Data (pip install 'ray[data]')")
    g.add_argument("--ray", action="store_true", help="run on Ray Data actors")
    g.add_argument("--ray-actors", type=int, default=2, help="actors, each holding an engine")
    g.add_argument("--ray-batch-size", type=int, default=64, help="lines per actor call")
    g.add_argument("--ray-cpus-per-actor", type=float, default=1.0, help="CPUs Ray reserves for each engine actor")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a local one)")
    add_engine_args(p)
    add_lora_modules_arg(p.add_argument_group("LoRA"),
                         "a line whose body names one as its model runs with it")
    p.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    """Run `tokenmill batch`."""
    config = engine_config_from_args(args)
    adapters = job_adapters(args.lora_modules, config)
    if args.ray:
        from tokenmill.batch.ray_job import run_batch_ray

        stats = run_batch_ray(args.input, args.output, config, num_actors=args.ray_actors,
                              batch_size=args.ray_batch_size,
                              cpus_per_actor=args.ray_cpus_per_actor, address=args.ray_address,
                              model_name=args.served_model_name,
                              max_in_flight=args.max_in_flight, progress=args.progress,
                              adapters=adapters)
    else:
        from tokenmill.batch.job import check_paths, run_batch
        from tokenmill.engine.llm_engine import LLMEngine

        check_paths(args.input, args.output)  # before the model loads
        engine = LLMEngine(config)
        for lora in adapters.values():  # a bad adapter fails the job now, not line by line
            engine.add_lora(lora)
        freeze_startup_heap()
        stats = run_batch(args.input, args.output, engine,
                          max_in_flight=args.max_in_flight, model_name=args.served_model_name,
                          progress=args.progress, adapters=adapters)
    print(stats.summary(), file=sys.stderr)
    return 0

