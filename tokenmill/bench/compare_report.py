"""The table and the plot of a `bench compare` result (see :mod:`tokenmill.bench.compare`)."""

from __future__ import annotations

import sys
from typing import Any

from tokenmill.bench.report import hardware_line, markdown_table
from tokenmill.bench.roofline import fraction

PEERS = ("llama.cpp", "transformers")


def pick(result: dict[str, Any], system: str, *path: str) -> Any:
    """``result["systems"][system][path...]``, None where any step is missing."""
    node: Any = result["systems"].get(system)
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def ratio(a: Any, b: Any) -> str | None:
    """tokenmill / peer, as '1.23x'."""
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return f"{a / b:.2f}x"


def _rows(result: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """(workload, tokenmill, llama.cpp, transformers) values."""
    cfg = result["config"]
    top, n_in, n_out = str(max(cfg["levels"])), cfg["latency_input_len"], cfg["output_len"]
    batch = cfg["batch_size"]

    def each(*path: str) -> tuple[Any, Any, Any]:
        return tuple(pick(result, s, *path) for s in ("tokenmill", *PEERS))  # type: ignore[return-value]

    def serve(key: str, level: str = top) -> tuple[Any, Any, Any]:
        return (pick(result, "tokenmill", "serve", "levels", level, key),
                pick(result, "llama.cpp", "serve", "levels", level, key), None)

    top_tp = serve("output_throughput")
    limit = result.get("roofline") or {}
    share = tuple(None if f is None else 100 * f
                  for f in (fraction(pick(result, s, "latency", "decode_tokens_per_s"), limit)
                            for s in ("tokenmill", "llama.cpp")))
    rows = [
        (f"single-stream decode, {n_out} tokens (out tok/s)", *each("latency", "decode_tokens_per_s")),
        ("single-stream decode, % of the memory roofline"
         + (f" ({limit['read_bandwidth_gb_s']:.1f} GB/s read / "
            f"{limit['weight_bytes_per_token'] / 2**20:.1f} MiB a token = "
            f"{limit['roofline_tokens_per_s']:.0f} tok/s"
            + (f"; one thread reads {limit['read_bandwidth_1_thread_gb_s']:.1f} GB/s"
               if "read_bandwidth_1_thread_gb_s" in limit else "") + ")" if limit else ""),
         *share, None),
        (f"prefill, {n_in}-token prompt (prompt tok/s)", *each("latency", "prefill_tokens_per_s")),
        (f"TTFT, {n_in}-token prompt (ms, lower is better)", *each("latency", "ttft_ms", "median")),
        (f"{top} concurrent streams x {n_out} tokens, HTTP server (out tok/s); transformers: "
         f"generate on a batch of {batch}", top_tp[0], top_tp[1],
         pick(result, "transformers", "batch", "output_tokens_per_s")),
        (f"offline batch of {batch} x {n_out} tokens (out tok/s)",
         pick(result, "tokenmill", "batch", "output_tokens_per_s"), None,
         pick(result, "transformers", "batch", "output_tokens_per_s")),
    ]
    rows += [(f"HTTP server, {c} streams (out tok/s)", *serve("output_throughput", str(c)))
             for c in cfg["levels"] if str(c) != top]
    rows += [
        (f"median TTFT at {top} streams (ms, lower is better)", *serve("median_ttft_ms")),
        (f"median ITL at {top} streams (ms, lower is better)", *serve("median_itl_ms")),
        (f"p99 ITL at {top} streams (ms, lower is better)", *serve("p99_itl_ms")),
        ("peak memory, single stream (MiB)", *each("latency", "peak_rss_mib")),
        (f"peak memory, HTTP server at {top} streams (MiB)", *serve_memory(result)),
        (f"peak memory, offline batch of {batch} (MiB)", pick(result, "tokenmill", "batch",
                                                              "peak_rss_mib"), None,
         pick(result, "transformers", "batch", "peak_rss_mib")),
    ]
    return rows


def serve_memory(result: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (pick(result, "tokenmill", "serve", "peak_rss_mib"),
            pick(result, "llama.cpp", "serve", "peak_rss_mib"), None)


def markdown_report(result: dict[str, Any]) -> str:
    """The ratio table with the hardware line, versions and any skipped or failed system."""
    headers = ["workload", "tokenmill", "llama.cpp", "tokenmill / llama.cpp", "transformers",
               "tokenmill / transformers"]
    table = [(name, tm, ll, ratio(tm, ll), hf, ratio(tm, hf)) for name, tm, ll, hf in _rows(result)]
    cfg = result["config"]
    lines = [
        f"Hardware: {hardware_line(result['hardware'])}; torch {result['hardware'].get('torch')}; "
        f"{cfg['threads']} threads for every system; model {cfg['model'].rsplit('/', 1)[-1]}; "
        f"tokenmill options: {' '.join(cfg.get('tokenmill_args') or []) or 'defaults'}.",
        "",
        markdown_table(headers, table),
        "",
    ]
    for system in ("tokenmill", *PEERS):
        entry = result["systems"].get(system, {})
        if "skipped" in entry:
            lines.append(f"- {system}: skipped ({entry['skipped']})")
        elif "error" in entry:
            lines.append(f"- {system}: failed ({entry['error'].splitlines()[0]})")
        else:
            lines.append(f"- {system} {entry.get('version', '')}")
            server = (entry.get("serve") or {}).get("command")
            if system == "llama.cpp" and server:
                lines.append(f"  - HTTP server: `{server}`" + (
                    " (started for each level with -np = streams)"
                    if entry["serve"].get("server") == "llama-server" else ""))
    if result.get("load_average_before"):
        before, after = result["load_average_before"][0], result["load_average_after"][0]
        lines.append(f"- load average (1 min) before / after the run: {before:.2f} / {after:.2f}")
    if result.get("command"):
        lines.append(f"\nCommand: `{result['command']}`")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> str | None:
    """Throughput, TTFT and ITL vs concurrency for each server, as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tokenmill[bench]')",
              file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [("output_throughput", "aggregate output tok/s", False),
              ("ttft", "TTFT (ms): median and p99", True),
              ("itl", "ITL (ms): median and p99", True)]
    for ax, (key, title, percentiles) in zip(axes, panels, strict=True):
        for system, color in (("tokenmill", "tab:blue"), ("llama.cpp", "tab:orange")):
            levels = pick(result, system, "serve", "levels") or {}
            xs = sorted(int(c) for c in levels)
            if not xs:
                continue
            if percentiles:
                for stat, style in (("median", "-o"), ("p99", "--^")):
                    ys = [levels[str(x)][f"{stat}_{key}_ms"] for x in xs]
                    ax.plot(xs, ys, style, color=color, label=f"{system} server, {stat}")
            else:
                ax.plot(xs, [levels[str(x)][key] for x in xs], "-o", color=color,
                        label=f"{system} server")
        if not percentiles:
            _batch_markers(ax, result)
        ax.set_xscale("log", base=2)
        if percentiles:  # queueing makes latencies span orders of magnitude
            ax.set_yscale("log")
        ticks = sorted({*result["config"]["levels"], result["config"]["batch_size"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{hardware_line(result['hardware'])}, {result['config']['threads']} threads, "
                 f"{result['config']['output_len']} output tokens per request", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _batch_markers(ax: Any, result: dict[str, Any]) -> None:
    """Offline batches (no server) as single points at x = batch size."""
    batch = result["config"]["batch_size"]
    for system, marker, color in (("tokenmill", "*", "tab:blue"), ("transformers", "s", "tab:green")):
        value = pick(result, system, "batch", "output_tokens_per_s")
        if value is not None:
            ax.plot([batch], [value], marker, color=color, markersize=10,
                    label=f"{system} offline batch of {batch}")
