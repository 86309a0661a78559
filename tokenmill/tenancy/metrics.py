"""Prometheus counters per project (label ``project``: the project id, which a rename does not
change), in the server's registry beside the per-model families."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter


class ProjectMetrics:
    """Requests, tokens, cost and refusals of each project."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["project", "model_name"]
        self.requests = Counter("tokenmill:project_requests",
                                "Finished API calls of a project by finish reason.",
                                [*labels, "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("tokenmill:project_prompt_tokens",
                                     "Prompt tokens of a project's calls.", labels,
                                     registry=registry)
        self.generation_tokens = Counter("tokenmill:project_generation_tokens",
                                         "Generated tokens of a project's calls.", labels,
                                         registry=registry)
        self.cost = Counter("tokenmill:project_cost",
                            "Cost of a project's calls (the currency of --cost-per-hour).",
                            labels, registry=registry)
        self.refused = Counter("tokenmill:project_rate_limited",
                               "Requests of a project refused with 429, by code.",
                               ["project", "code"], registry=registry)

    def record(self, row: dict[str, Any]) -> None:
        """Count one usage row (see TenancyStore.record_usage)."""
        labels = (row["project_id"], row["model"])
        self.requests.labels(*labels, row["finish_reason"] or "none").inc()
        self.prompt_tokens.labels(*labels).inc(row["input_tokens"])
        self.generation_tokens.labels(*labels).inc(row["output_tokens"])
        self.cost.labels(*labels).inc(row["cost"])
