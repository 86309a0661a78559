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
from collections.abc import Iterator
from typing import Any

from tokenmill.api.batch_format import BatchRequest
from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.batch.job import BatchStats, answer_lines, check_paths
from tokenmill.batch.processor import Answer
from tokenmill.config import EngineConfig
from tokenmill.lora_request import LoRARequest

RAY_MISSING = ("the Ray batch mode needs Ray Data, which is not installed: "
               "pip install -c constraints.txt 'ray[data]'")


class EngineActor:
    """A Ray Data actor: loads one engine, then answers each batch of rows it is handed.

    A batch is answered as a whole (its requests run together in the engine), so
    ``batch_size`` is both the unit of work and each actor's batching depth.
    """

    def __init__(self, config: EngineConfig, model_name: str | None, max_in_flight: int,
                 adapters: dict[str, LoRARequest] | None = None) -> None:
        from tokenmill.batch.processor import BatchProcessor
        from tokenmill.engine.llm_engine import LLMEngine

        self.processor = BatchProcessor(LLMEngine(config), model_name, max_in_flight,
                                        adapters)

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
                  progress: bool = True,
                  adapters: dict[str, LoRARequest] | None = None) -> BatchStats:
    """Answer every line of ``input_path`` into ``output_path`` on Ray Data, with
    ``num_actors`` actors that each load an engine from ``config`` (and serve ``adapters``,
    as ``run_batch`` does).

    ``address`` is a Ray cluster to join (default: $RAY_ADDRESS, else a local Ray started for
    this job and stopped after it). Each actor reserves ``cpus_per_actor`` CPUs and, unless
    ``config`` sets a thread count, uses that many threads. Resumes like ``run_batch``.
    """
    try:  # here, so that a missing Ray fails the job before any work
        import ray.data  # noqa: F401
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

    pool = _ActorPool(config, model_name, max_in_flight, num_actors, batch_size,
                      cpus_per_actor, address, dict(adapters or {}))
    return answer_lines(input_path, output_path, progress, pool.answer)


@dataclasses.dataclass(frozen=True)
class _ActorPool:
    """How the job's requests are handed to Ray Data actors (see ``run_batch_ray``)."""

    config: EngineConfig
    model_name: str | None
    max_in_flight: int
    num_actors: int
    batch_size: int
    cpus_per_actor: float
    address: str | None
    adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)

    def answer(self, requests: Iterator[BatchRequest]) -> Iterator[Answer]:
        """The actors' answers, as they arrive; Ray runs only while there is work."""
        import ray
        import ray.data

        # The whole plan first (its bad lines are answered meanwhile): Ray Data wants rows.
        rows = [{"line": r.line, "custom_id": r.custom_id, "url": r.url,
                 "body": json.dumps(r.body)} for r in requests]
        if not rows:
            return
        actor_kwargs = {"config": self.config, "model_name": self.model_name,
                        "max_in_flight": self.max_in_flight, "adapters": self.adapters}
        started = not ray.is_initialized()
        if started:
            ray.init(address=self.address, include_dashboard=False)
        try:
            # The job's own bar counts requests and tokens; Ray's bars would fight with it.
            ray.data.DataContext.get_current().enable_progress_bars = False
            answers = ray.data.from_items(rows).map_batches(
                EngineActor, batch_size=self.batch_size, concurrency=self.num_actors,
                num_cpus=self.cpus_per_actor, batch_format="numpy",
                fn_constructor_kwargs=actor_kwargs)
            for row in answers.iter_rows():
                yield Answer(int(row["line"]), str(row["text"]), bool(row["ok"]),
                             int(row["prompt_tokens"]), int(row["output_tokens"]))
        finally:
            if started:
                ray.shutdown()
