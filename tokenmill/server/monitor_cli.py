"""The drift monitor on the command line: `tokenmill serve`'s monitoring options, and
`tokenmill monitor save-reference` against a running server."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from tokenmill import envs
from tokenmill.config import MonitorConfig
from tokenmill.monitoring.profile import parse_profile

# Seconds the server has to answer.
MONITOR_TIMEOUT_S = 60.0


def add_monitor_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill serve`'s drift-monitoring options."""
    g = p.add_argument_group("drift monitoring")
    g.add_argument("--no-monitor", action="store_true",
                   help="turn the drift monitor off (no tokenmill:drift_score, no "
                   "/admin/monitoring)")
    g.add_argument("--monitor-reference-size", type=int, default=MonitorConfig.reference_size,
                   metavar="N", help="the reference is the first N finished sequences of each "
                   "model (unless --monitor-reference gives one)")
    g.add_argument("--monitor-window", type=int, default=MonitorConfig.window, metavar="N",
                   help="the live window: the last N finished sequences")
    g.add_argument("--monitor-reference", default=None, metavar="FILE",
                   help="a reference profile saved by `tokenmill monitor save-reference`")
    g.add_argument("--drift-threshold", type=float, default=MonitorConfig.drift_threshold,
                   help="log a warning when a signal's drift score (PSI) crosses this "
                   "(0.1: moderate, 0.25: major change)")
    g.add_argument("--monitor-embedding-budget", type=float,
                   default=MonitorConfig.embedding_budget, metavar="SHARE",
                   help="the share of time the embedding model may spend embedding prompts for "
                   "the prompt_embedding signal; beyond it prompts are sampled")


def monitor_config_from_args(args: argparse.Namespace) -> MonitorConfig:
    """The MonitorConfig of `tokenmill serve`'s options."""
    return MonitorConfig(enabled=not args.no_monitor,
                         reference_size=args.monitor_reference_size, window=args.monitor_window,
                         reference_path=args.monitor_reference,
                         drift_threshold=args.drift_threshold,
                         embedding_budget=args.monitor_embedding_budget)


def add_monitor_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill monitor save-reference`."""
    p = subparsers.add_parser("monitor", help="the drift monitor of a running server")
    sub = p.add_subparsers(dest="action", required=True)
    save = sub.add_parser("save-reference", help="store the live window of the server's "
                          "models as a reference profile (for serve --monitor-reference)")
    save.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    save.add_argument("--admin-key", default=None,
                      help="the server's --admin-key (default: $TOKENMILL_ADMIN_KEY)")
    save.add_argument("--model", default=None, help="only this model (default: every one)")
    save.add_argument("--output", "-o", required=True, metavar="FILE",
                      help="where to write the profile (JSON)")
    p.set_defaults(func=cmd_monitor)


def cmd_monitor(args: argparse.Namespace) -> int:
    """Fetch the live windows and write them to --output; 1 if the server refused."""
    key = args.admin_key or envs.TOKENMILL_ADMIN_KEY
    if not key:
        raise ValueError("tokenmill monitor needs the server's admin key (--admin-key or "
                         "$TOKENMILL_ADMIN_KEY)")
    params = {"model": args.model} if args.model else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/admin/monitoring/reference", params=params,
                      headers={"Authorization": f"Bearer {key}"}, timeout=MONITOR_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.url}: {e}") from None
    if not r.is_success:
        print(f"tokenmill: the server answered {r.status_code}: {r.text}", file=sys.stderr)
        return 1
    profile = parse_profile(r.json())  # what --monitor-reference will accept
    tmp = f"{args.output}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(profile.as_dict(), f)
    os.replace(tmp, args.output)
    for name, m in profile.models.items():
        print(f"saved {m.requests} requests of {name!r} to {args.output}")
    return 0
