"""A batch job over files: read the input, skip what earlier runs answered, write each answer.

The same planning and bookkeeping serve the single-process job (``run_batch``) and the Ray Data
one (tokenmill/batch/ray_job.py): only who runs the engine differs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from tqdm import tqdm

from tokenmill.api.batch_format import BatchRequest, LineError, error_line, output_id, parse_line
from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.batch.processor import Answer, BatchProcessor
from tokenmill.batch.results import ResultsFile
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora_request import LoRARequest


@dataclass
class BatchStats:
    """What one run did; lines that earlier runs answered only count in ``skipped``."""

    skipped: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def answered(self) -> int:
        return self.succeeded + self.failed

    def summary(self) -> str:
        """One line for the terminal."""
        secs = max(self.elapsed_s, 1e-9)
        return (f"{self.answered} lines answered ({self.succeeded} ok, {self.failed} errors), "
                f"{self.skipped} answered by earlier runs; {self.elapsed_s:.1f} s, "
                f"{self.answered / secs:.2f} req/s, {self.output_tokens / secs:.1f} output tok/s")


def check_paths(input_path: str, output_path: str) -> None:
    """ValueError naming the path when the job cannot run."""
    if not os.path.isfile(input_path):
        raise ValueError(f"input file {input_path!r} does not exist")
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ValueError("the output file must not be the input file")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise ValueError(f"the output file's folder {folder!r} does not exist")


def count_lines(path: str) -> int:
    """Non-blank lines: the progress bar's total."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def plan(input_path: str, results: ResultsFile,
         stats: BatchStats) -> Iterator[BatchRequest | LineError]:
    """Each input line that no earlier run answered, parsed; a repeated custom_id is an error
    (its first line is the one that runs)."""
    seen: dict[str, int] = {}
    with open(input_path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            item = parse_line(number, raw)
            if item.custom_id is not None:
                first = seen.setdefault(item.custom_id, number)
                if first != number:
                    item = LineError(number, None, f"line {number}: custom_id "
                                     f"{item.custom_id!r} is already used on line {first}; "
                                     "custom_ids must be unique")
            if results.is_done(output_id(number), item.custom_id):
                stats.skipped += 1
                continue
            yield item


@dataclass
class Recorder:
    """Writes answers, counts them and moves the progress bar (requests/s and tokens/s)."""

    results: ResultsFile
    bar: tqdm
    stats: BatchStats = field(default_factory=BatchStats)
    start: float = field(default_factory=time.perf_counter)

    def error(self, err: LineError) -> None:
        self.results.append(error_line(err))
        self.stats.failed += 1
        self._tick()

    def answer(self, answer: Answer) -> None:
        self.results.append(answer.text)
        stats = self.stats
        if answer.ok:
            stats.succeeded += 1
        else:
            stats.failed += 1
        stats.prompt_tokens += answer.prompt_tokens
        stats.output_tokens += answer.output_tokens
        self._tick()

    def _tick(self) -> None:
        self.stats.elapsed_s = time.perf_counter() - self.start
        self.bar.update(1)
        self.bar.set_postfix_str(
            f"{self.stats.output_tokens / max(self.stats.elapsed_s, 1e-9):.1f} out tok/s",
            refresh=False)


def progress_bar(input_path: str, results: ResultsFile, show: bool) -> tqdm:
    return tqdm(total=count_lines(input_path), initial=len(results.done_ids), desc="batch",
                unit="req", disable=not show, dynamic_ncols=True)


def answer_lines(input_path: str, output_path: str, progress: bool,
                 answer: Callable[[Iterator[BatchRequest]], Iterable[Answer]]) -> BatchStats:
    """The job around whoever runs the engine: plan the lines that still need answers, answer
    the bad ones here, hand the requests to ``answer`` and record each Answer it yields."""
    with ResultsFile(output_path) as results, progress_bar(input_path, results, progress) as bar:
        rec = Recorder(results, bar)

        def requests() -> Iterator[BatchRequest]:
            for item in plan(input_path, results, rec.stats):
                if isinstance(item, LineError):
                    rec.error(item)
                else:
                    yield item

        for done in answer(requests()):
            rec.answer(done)
        rec.stats.elapsed_s = time.perf_counter() - rec.start
    return rec.stats


def run_batch(input_path: str, output_path: str, engine: LLM | LLMEngine, *,
              max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, model_name: str | None = None,
              progress: bool = True,
              adapters: Mapping[str, LoRARequest] | None = None) -> BatchStats:
    """Answer every line of ``input_path`` (OpenAI Batch JSONL) into ``output_path``.

    Answers are appended as they finish, so running it again after a crash or a kill resumes:
    lines already answered are skipped and each custom_id ends up answered exactly once.
    ``model_name`` is the ``model`` of the response bodies (default: the model file's name).
    ``adapters``: LoRA adapters by the name a line's ``model`` gives (see BatchProcessor).
    """
    check_paths(input_path, output_path)
    if isinstance(engine, LLM):
        engine = engine.engine
    processor = BatchProcessor(engine, model_name, max_in_flight, adapters)
    return answer_lines(input_path, output_path, progress, processor.run)
