"""Who a request belongs to while the server handles it, and the metering of its engine
outputs: tokens counted towards the project's per-minute limit as the engine produces them,
and one usage row (tokens, cost, finish reason, latency) when the call ends.

The server's tenancy guard sets ``current_tab`` for a request made with a project key; the
code that queues engine requests reads it (``meter``) without knowing about projects."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tenancy.limits import Limiter, month_start
from tokenmill.tenancy.metrics import ProjectMetrics
from tokenmill.tenancy.store import Caller, TenancyStore


@dataclass
class Tab:
    """One HTTP request of a project: its caller and where its usage goes."""

    caller: Caller
    store: TenancyStore
    limiter: Limiter
    metrics: ProjectMetrics | None = None
    # Keep the prompt and answer text in the request's audit record (--audit-log-content).
    content: bool = False
    started: float = field(default_factory=time.monotonic)

    def priority(self, requested: int) -> int:
        """The priority a request runs with: its own ``priority`` field, never more urgent
        (lower) than its project's class allows."""
        return max(requested, self.caller.project.priority)


# The stop reason of an answer cut short because its project's monthly budget ran out.
BUDGET_NOTE = "the project's monthly budget is spent"

current_tab: contextvars.ContextVar[Tab | None] = contextvars.ContextVar(
    "tokenmill_tenancy_tab", default=None)


def with_priority(params: Any) -> Any:
    """``params`` with the priority the current project allows (unchanged outside a project,
    and for params without a priority, such as pooling's)."""
    tab = current_tab.get()
    if tab is None or not hasattr(params, "priority"):
        return params
    wanted = tab.priority(params.priority)
    return params if wanted == params.priority else dataclasses.replace(params, priority=wanted)


def meter(group: Any, model: str, model_path: str = "") -> Any:
    """``group`` (an engine RequestGroup) counted for the current project; itself when the
    request has no project. ``model_path``: the served model's weights (for its version)."""
    tab = current_tab.get()
    return group if tab is None else MeteredGroup(group, tab, model, model_path)


@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, stamp: tuple) -> str:
    return hashlib.sha256(f"{path}:{stamp}".encode()).hexdigest()[:16]


def model_version(path: str) -> str | None:
    """A fingerprint of a model's weights: its path and its files' sizes and modification
    times (hashing gigabytes of weights per load would be too slow); a swap to other weights
    changes it. None for no path."""
    if not path or not os.path.exists(path):
        return None
    real = os.path.realpath(path)
    files = ([os.path.join(real, n) for n in sorted(os.listdir(real))]
             if os.path.isdir(real) else [real])
    stamp = tuple((os.path.basename(f), st.st_size, st.st_mtime_ns)
                  for f in files if os.path.isfile(f) for st in [os.stat(f)])
    return _fingerprint(real, stamp)


class MeteredGroup:
    """A RequestGroup whose outputs are counted as they arrive: every attribute is the
    group's, iteration counts tokens, and the end (or ``close``) writes the usage row."""

    def __init__(self, group: Any, tab: Tab, model: str, model_path: str = "") -> None:
        self._group = group
        self._tab = tab
        self._model = model
        self._model_path = model_path
        self._prompt_seen: set[int] = set()
        self._input = self._output = 0
        self._cost: dict[int, float] = {}
        self._finish: str | None = None
        self._kind = "completions"
        self._recorded = False
        self._prompts: dict[int, str | None] = {}
        self._answers: dict[tuple[int, int], str] = {}
        # What the project had spent this month when the call started (its budget's base).
        budget = tab.caller.project.monthly_budget
        self._spent_before = (None if budget is None else tab.store.spent_since(
            tab.caller.project.id, month_start(time.time())))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        try:
            async for index, out in self._group:
                self._count(index, out)
                yield index, out
        finally:
            self._record()

    def _count(self, index: int, out: Any) -> None:
        new = 0
        if index not in self._prompt_seen:
            self._prompt_seen.add(index)
            new += len(out.prompt_token_ids)
            self._input += len(out.prompt_token_ids)
        if hasattr(out, "embedding"):
            self._kind = "embeddings"
        else:
            generated = sum(len(o.token_ids) for o in out.outputs)
            new += generated
            self._output += generated
            reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
            self._finish = reasons[-1] if reasons else self._finish
        self._cost[index] = out.metrics.usage.cost_usd
        if self._tab.content:
            self._prompts.setdefault(index, out.prompt)
            for o in getattr(out, "outputs", []):
                key = (index, o.index)
                self._answers[key] = self._answers.get(key, "") + o.text
        self._tab.limiter.add_tokens(self._tab.caller.project.id, new)
        if self._over_budget() and not out.finished and not hasattr(out, "embedding"):
            self._end_for_budget(out)

    def _over_budget(self) -> bool:
        budget = self._tab.caller.project.monthly_budget
        return (budget is not None and self._spent_before is not None
                and self._spent_before + sum(self._cost.values()) >= budget)

    def _end_for_budget(self, out: Any) -> None:
        """End the call here: this output is its last, with finish reason ``length`` and
        BUDGET_NOTE as its stop reason; the engine drops the rest."""
        for o in out.outputs:
            if o.finish_reason is None:
                o.finish_reason, o.stop_reason = "length", BUDGET_NOTE
        out.finished = True
        self._finish = "length"
        self._group.close()

    def close(self) -> None:
        """Close the group, recording what it used."""
        self._group.close()
        self._record()

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        caller = self._tab.caller
        row = {"time": time.time(), "project_id": caller.project.id, "key_id": caller.key_id,
               "model": self._model, "kind": self._kind, "input_tokens": self._input,
               "output_tokens": self._output, "cost": sum(self._cost.values()),
               "finish_reason": self._finish, "latency": time.monotonic() - self._tab.started}
        content: dict[str, Any] = {"model_version": model_version(self._model_path)}
        if self._tab.content:
            content |= {"prompts": [self._prompts[i] for i in sorted(self._prompts)],
                       "answers": [self._answers[k] for k in sorted(self._answers)]}
        self._tab.store.record_usage(row, content)
        if self._tab.metrics is not None:
            self._tab.metrics.record(row)
