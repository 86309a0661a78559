"""The batch job on Ray Data: the same lines, answered by a pool of actors that each hold an
engine, for jobs that outgrow one machine.

The driver plans the job exactly as the single-process one does (skipping what earlier runs
answered, answering bad lines itself) and streams the actors' answers into the same results
file as they arrive, so a killed Ray job resumes the same way. Ray is imported only here, and
only when such a job runs: it is an optional dependency.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.batch.format import BatchRequest, LineError
from tokenmill.batch.job import BatchStats, Recorder, check_paths, plan, progress_bar
from tokenmill.batch.processor import Answer
from tokenmill.batch.results import ResultsFile
from tokenmill.config import EngineConfig

RAY_MISSING = ("the Ray batch mode needs Ray Data, which is not installed: "
               "pip install -c constraints.txt 'ray[data]'")


class EngineActor:
    """A Ray Data actor: loads one engine, then answers each batch of rows it is handed.

    A batch is answered as a whole (its requests run together in the engine), so
    ``batch_size`` is both the unit of work and each actor's batching depth.
    """

    def __init__(self, config: EngineConfig, model_name: str | None, max_in_flight: int) -> None:
        from tokenmill.batch.processor import BatchProcessor
        from tokenmill.engine.llm_engine import LLMEngine
        from tokenmill.server.launcher import model_name as default_name

        engine = LLMEngine(config)
        self.processor = BatchProcessor(
            engine, model_name or default_name(engine.model_path), max_in_flight)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        requests = [BatchRequest(int(line), str(custom_id), str(url), json.loads(body))
                    for line, custom_id, url, body in zip(batch["line"], batch["custom_id"],
                                                          batch["url"], batch["body"],
                                                          strict=True)]
        answers = list(self.processor.run(requests))
        return {name: np.array([getattr(a, name) for a in answers])
                for name in ("line", "text", "ok", "prompt_tokens", "output_tokens")}


def run_batch_ray(input_path: str, output_path: str, config: EngineConfig, *,
                  num_actors: int = 2, batch_size: int = 64, cpus_per_actor: float = 1.0,
                  address: str | None = None, model_name: str | None = None,
                  max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                  progress: bool = True) -> BatchStats:
    """Answer every line of ``input_path`` into ``output_path`` on Ray Data, with
    ``num_actors`` actors that each load an engine from ``config``.

    ``address`` is a Ray cluster to join (default: $RAY_ADDRESS, else a local Ray started for
    this job and stopped after it). Each actor reserves ``cpus_per_actor`` CPUs and, unless
    ``config`` sets a thread count, uses that many threads. Resumes like ``run_batch``.
    """
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ValueError(f"{RAY_MISSING} ({e})") from None
    if num_actors < 1:
        raise ValueError(f"num_actors must be >= 1, got {num_actors}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if cpus_per_actor <= 0:
        raise ValueError(f"cpus_per_actor must be > 0, got {cpus_per_actor}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    check_paths(input_path, output_path)
    if config.device.num_threads is None:
        threads = max(1, int(cpus_per_actor))
        config = dataclasses.replace(
            config, device=dataclasses.replace(config.device, num_threads=threads))

    with ResultsFile(output_path) as results, progress_bar(input_path, results, progress) as bar:
        rec = Recorder(results, bar)
        rows = []
        for item in plan(input_path, results, rec.stats):
            if isinstance(item, LineError):
                rec.error(item)
            else:
                rows.append({"line": item.line, "custom_id": item.custom_id, "url": item.url,
                             "body": json.dumps(item.body)})
        if rows:
            actor_kwargs = {"config": config, "model_name": model_name,
                            "max_in_flight": max_in_flight}
            started = not ray.is_initialized()
            if started:
                ray.init(address=address, include_dashboard=False)
            try:
                # The job's own bar counts requests and tokens; Ray's bars would fight with it.
                ray.data.DataContext.get_current().enable_progress_bars = False
                answers = ray.data.from_items(rows).map_batches(
                    EngineActor, batch_size=batch_size, concurrency=num_actors,
                    num_cpus=cpus_per_actor, batch_format="numpy",
                    fn_constructor_kwargs=actor_kwargs)
                for row in answers.iter_rows():
                    rec.answer(Answer(int(row["line"]), str(row["text"]), bool(row["ok"]),
                                      int(row["prompt_tokens"]), int(row["output_tokens"])))
            finally:
                if started:
                    ray.shutdown()
        rec.stats.elapsed_s = time.perf_counter() - rec.start
    return rec.stats
