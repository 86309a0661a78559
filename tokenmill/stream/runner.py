"""The stream loop: read what has arrived, batch it in the engine, write and acknowledge results.

Each turn reads as many records as there are free in-flight slots (without waiting while the
engine has work, so arrivals join the running batch at the next step), runs one engine step,
then writes the finished results and only then acknowledges their records. At most
``max_in_flight`` records are read and unanswered at any time: beyond that the source is not
read, and the backlog waits in the pipe or in Redis (backpressure).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Protocol

from tokenmill.api.chat import chat_prompt
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.stream.metrics import StreamStats
from tokenmill.stream.records import Latency, PromptTemplate, Record, StreamResult, Usage


class Source(Protocol):
    """Where records come from (stdin, a Redis consumer group)."""

    exhausted: bool  # no record will ever come again

    def read(self, max_records: int, timeout: float) -> list[Record]: ...

    def ack(self, records: list[Record]) -> None: ...


class Sink(Protocol):
    """Where results go (stdout, a Redis stream); ``write`` returns once they are stored."""

    def write(self, results: list[tuple[Record, str]]) -> None: ...


class StreamRunner:
    """Answers records from ``source`` into ``sink`` with one engine until the source ends,
    ``stop()`` is called, or nothing has arrived for ``exit_when_idle_s`` seconds.

    ``adapters``: LoRA adapters by name; a record whose ``lora_field`` names one runs with it
    (a record without the field runs the base model; one naming no adapter is answered with
    that error)."""

    def __init__(self, engine: LLMEngine, source: Source, sink: Sink, template: PromptTemplate,
                 params: SamplingParams, *, max_in_flight: int = 64, chat: bool = False,
                 poll_s: float = 0.1, exit_when_idle_s: float | None = None,
                 adapters: Mapping[str, LoRARequest] | None = None,
                 lora_field: str = "model") -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        params.validate(vocab_size=engine.vocab_size)
        if params.n != 1:
            raise ValueError(f"a stream job samples one output per record (n=1), got n={params.n}")
        self.engine, self.source, self.sink = engine, source, sink
        self.template, self.params, self.chat = template, params, chat
        self.max_in_flight, self.poll_s = max_in_flight, poll_s
        self.exit_when_idle_s = exit_when_idle_s
        self.adapters, self.lora_field = dict(adapters or {}), lora_field
        self.stats = StreamStats()
        self._in_flight: dict[str, Record] = {}  # engine request id -> record
        self._ids = itertools.count()
        self._stopping = False

    def stop(self) -> None:
        """Read nothing more; finish the records in flight, then return from ``run``."""
        self._stopping = True

    def run(self) -> StreamStats:
        engine, source = self.engine, self.source
        last_arrival = time.monotonic()
        while True:
            busy = engine.has_unfinished_requests()
            free = self.max_in_flight - len(self._in_flight)
            records: list[Record] = []
            if free > 0 and not self._stopping and not source.exhausted:
                records = source.read(free, 0.0 if busy else self.poll_s)
            done = [r for r in map(self._submit, records) if r is not None]
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        record = self._in_flight.pop(out.request_id)
                        done.append((record, self._result(record, out)))
            if done:
                self._deliver(done)
            now = time.monotonic()
            if records:
                last_arrival = now
            if self._in_flight:
                continue
            idle = self.exit_when_idle_s is not None and now - last_arrival >= self.exit_when_idle_s
            if self._stopping or source.exhausted or idle:
                return self.stats

    def _submit(self, record: Record) -> tuple[Record, StreamResult] | None:
        """Queue a record in the engine; a record that cannot be is answered with its error."""
        if record.fields is None:
            return record, StreamResult(id=record.id, error=record.error)
        rid = f"s{next(self._ids)}"
        try:
            prompt = self._prompt(self.template.render(record.fields))
            self.engine.add_request(rid, prompt, self.params, arrival_time=record.received,
                                    lora_request=self._adapter(record.fields))
        except ValueError as e:
            return record, StreamResult(id=record.id, record=record.fields,
                                        error=f"record {record.id}: {e}")
        self._in_flight[rid] = record
        return None

    def _adapter(self, fields: dict) -> LoRARequest | None:
        """The adapter the record's ``lora_field`` names (None without adapters or field)."""
        if not self.adapters or self.lora_field not in fields:
            return None
        name = fields[self.lora_field]
        adapter = self.adapters.get(name) if isinstance(name, str) else None
        if adapter is None:
            raise ValueError(f"field {self.lora_field!r} is {name!r}, which names no LoRA "
                             f"adapter ({', '.join(map(repr, self.adapters))})")
        return adapter

    def _prompt(self, text: str) -> PromptType:
        if not self.chat:
            return text
        rendered, ids = chat_prompt(self.engine.tokenizer, [{"role": "user", "content": text}])
        return {"prompt": rendered, "prompt_token_ids": ids}

    @staticmethod
    def _result(record: Record, out: RequestOutput) -> StreamResult:
        c, m = out.outputs[0], out.metrics
        return StreamResult(
            id=record.id, record=record.fields, text=c.text, finish_reason=c.finish_reason,
            usage=Usage(prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(c.token_ids)),
            latency=Latency(source_wait_s=record.source_wait_s, queue_s=m.queue_time,
                            ttft_s=m.time_to_first_token, e2e_s=m.e2e_latency))

    def _deliver(self, done: list[tuple[Record, StreamResult]]) -> None:
        """Write, then acknowledge: a crash in between redelivers, it never loses a record."""
        self.sink.write([(record, result.model_dump_json()) for record, result in done])
        self.source.ack([record for record, _ in done])
        for _, result in done:
            self.stats.add(result)
