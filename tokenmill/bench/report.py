"""Output of the benchmarks: JSON files, terminal and markdown tables, hardware and memory facts."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import resource
import subprocess
from collections.abc import Sequence
from typing import Any

from tokenmill import envs


def now_iso() -> str:
    """The local time, to the second, for result files."""
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line(program: str, args: Sequence[str]) -> str:
    """The command a result came from, as a shell would run it again: the ``TOKENMILL_*``
    variables set (experiments that are off by default, tuning files), then ``program`` and
    ``args``."""
    env = [f"{k}={v}" for k, v in envs.tokenmill_settings().items()]
    return " ".join([*env, program, *args])


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, creating the folder; NaN/inf become null (valid JSON)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(obj), f, indent=2)
        f.write("\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (or what the platform module knows)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    """What the numbers were measured on."""
    mem_gib = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                            "memory_gib": round(mem_gib, 1) if mem_gib else None,
                            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def hardware_line(hw: dict[str, Any]) -> str:
    """One line for a README: model name, cores, memory."""
    mem = f", {hw['memory_gib']:.0f} GiB" if hw.get("memory_gib") else ""
    return f"{hw['cpu']}, {hw['cores']} cores{mem}"


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_peak_rss_mib(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of a running process and its children, None if unknown."""
    total, found = 0.0, False
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) / 1024
                        found = True
        except OSError:
            continue
    return total if found else None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            kids = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one of l/r per column (default: first left)."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def format_serve_table(r: dict[str, Any], percentiles: Sequence[float]) -> str:
    """vLLM-style result block of one `bench serve` run."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
        ("Maximum request concurrency", r["max_concurrency"] or "-"),
        ("Benchmark duration (s)", r["duration"]),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Total token throughput (tok/s)", r["total_token_throughput"]),
        ("Peak concurrent requests", r["max_concurrent_requests"]),
    ]
    if r.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", r["request_goodput"]))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    lines = [f"{' Serving Benchmark Result ':=^60}"]
    lines += [_kv(k, v) for k, v in rows]
    for name, title in titles.items():
        lines.append(f"{title:-^60}")
        lines.append(_kv(f"Mean {name.upper()} (ms)", r[f"mean_{name}_ms"]))
        lines.append(_kv(f"Median {name.upper()} (ms)", r[f"median_{name}_ms"]))
        lines += [_kv(f"P{p:g} {name.upper()} (ms)", r[f"p{p:g}_{name}_ms"]) for p in percentiles]
    first_error = next((e for e in r.get("errors", []) if e), None)
    if first_error:
        lines.append(f"first error: {first_error}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _kv(key: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{key:<44}{text:>16}"
