"""`tokenmill stream`: records from stdin or a Redis Stream through a prompt template and the
engine, results to stdout or a Redis Stream, at-least-once."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from types import FrameType

from tokenmill.engine.args import (
    add_engine_args,
    add_lora_modules_arg,
    add_sampling_args,
    engine_config_from_args,
    job_adapters,
    sampling_params_from_args,
)
from tokenmill.utils import freeze_startup_heap


def add_stream_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill stream`."""
    p = subparsers.add_parser(
        "stream", help="answer records from stdin or a Redis Stream as they arrive",
        description="Read JSON records from stdin (one object per line) or entries of a Redis "
                    "Stream (consumer group), fill --template with their fields, generate in "
                    "micro-batches, and write one result per record to stdout or a Redis "
                    "Stream. A record is acknowledged only after its result is written.")
    p.add_argument("--template", required=True,
                   help="prompt template over the record's fields, e.g. 'Classify: {text}'")
    p.add_argument("--chat", action="store_true",
                   help="send the filled template as a user message through the chat template")
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="records read but not yet answered, at most (backpressure)")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="exit once nothing has arrived or been in flight for this long")
    g = p.add_argument_group("redis", "read from and write to Redis Streams (pip install redis)")
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the Redis server")
    g.add_argument("--input-stream", default=None, help="read this stream instead of stdin")
    g.add_argument("--group", default="tokenmill", help="consumer group of the input stream")
    g.add_argument("--consumer", default=None,
                   help="consumer name; restart under the same name to re-read its pending "
                        "entries at once (default: host-pid)")
    g.add_argument("--start-id", default="0",
                   help="where a new group starts: 0 = the whole stream, $ = new entries only")
    g.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="take over entries another consumer left pending this long")
    g.add_argument("--output-stream", default=None, help="write results here instead of stdout")
    g = p.add_argument_group("LoRA")
    add_lora_modules_arg(g, "a record whose --lora-field names one runs with it")
    g.add_argument("--lora-field", default="model",
                   help="the record field that names its adapter (absent: the base model)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_stream)


def cmd_stream(args: argparse.Namespace) -> int:
    """Run `tokenmill stream` until stdin ends, SIGTERM / SIGINT, or --exit-when-idle."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.stream.records import PromptTemplate
    from tokenmill.stream.runner import StreamRunner
    from tokenmill.stream.stdio import LineSink, LineSource

    template = PromptTemplate(args.template)
    params = sampling_params_from_args(args)
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    client = None
    if args.input_stream is not None or args.output_stream is not None:
        from tokenmill.stream.redis_io import connect

        client = connect(args.redis_url)  # before the model loads: fail fast
    config = engine_config_from_args(args)
    adapters = job_adapters(args.lora_modules, config)
    engine = LLMEngine(config)
    for lora in adapters.values():  # a bad adapter fails the job now, not record by record
        engine.add_lora(lora)
    freeze_startup_heap()
    if args.input_stream is not None:
        from tokenmill.stream.redis_io import RedisSource

        consumer = args.consumer or f"{socket.gethostname()}-{os.getpid()}"
        source = RedisSource(client, args.input_stream, args.group, consumer,
                             start_id=args.start_id, claim_idle_ms=args.claim_idle_ms)
    else:
        source = LineSource(sys.stdin.buffer, args.max_in_flight)
    if args.output_stream is not None:
        from tokenmill.stream.redis_io import RedisSink

        sink = RedisSink(client, args.output_stream)
    else:
        sink = LineSink(sys.stdout)
    runner = StreamRunner(engine, source, sink, template, params,
                          max_in_flight=args.max_in_flight, chat=args.chat,
                          exit_when_idle_s=args.exit_when_idle, adapters=adapters,
                          lora_field=args.lora_field)

    def stop(signum: int, frame: FrameType | None) -> None:
        runner.stop()  # finish what is in flight; a second signal ends the process at once
        signal.signal(signum, signal.SIG_DFL)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stats = runner.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(stats.summary(), file=sys.stderr)
    return 0
