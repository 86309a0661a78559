"""`tokenmill models`: the admin API of a running server from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from tokenmill import envs

# Seconds a load or swap may take (a large model loads for minutes).
ADMIN_TIMEOUT_S = 1800.0


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill models list|load|unload|swap`."""
    p = subparsers.add_parser("models", help="list, load, unload or swap the models of a "
                              "running server (its admin API)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--admin-key", default=None,
                   help="the server's --admin-key (default: $TOKENMILL_ADMIN_KEY)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, for list without "
                   "the admin key (default: $TOKENMILL_API_KEY)")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the served models (GET /v1/models); with the admin key, "
                   "also their state and memory (the admin API)")
    load = sub.add_parser("load", help="load a model under a new name")
    load.add_argument("name")
    load.add_argument("path")
    unload = sub.add_parser("unload", help="drain a model and unload it")
    unload.add_argument("name")
    swap = sub.add_parser("swap", help="blue/green: load a new version, drain the old one")
    swap.add_argument("name")
    swap.add_argument("path")
    for q in (load, swap):
        q.add_argument("--option", "-o", action="append", default=[], metavar="KEY[=VALUE]",
                       help="an engine option of the model, as --model takes them "
                       "(max-model-len=2048, int8, ...; repeatable)")
    p.set_defaults(func=cmd_models)


def _options(values: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in values:
        key, sep, value = v.partition("=")
        out[key] = value if sep else True
    return out


def _list_served(args: argparse.Namespace) -> int:
    """`models list` without the admin key: the OpenAI API's model list, as JSON."""
    key = args.api_key or envs.TOKENMILL_API_KEY
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    return _print(r)


def _print(r: httpx.Response) -> int:
    try:
        body = r.json()
    except ValueError:
        body = {"status": r.status_code, "text": r.text}
    json.dump(body, sys.stdout, indent=2)
    print()
    return 0 if r.is_success else 1


def cmd_models(args: argparse.Namespace) -> int:
    """Run one admin call (or list the served models without the admin key) and print its
    JSON answer; 1 if the server refused it."""
    key = args.admin_key or envs.TOKENMILL_ADMIN_KEY
    if not key and args.action == "list":
        return _list_served(args)
    if not key:
        raise ValueError("tokenmill models needs the server's admin key (--admin-key or "
                         "$TOKENMILL_ADMIN_KEY)")
    base = args.url.rstrip("/") + "/admin/models"
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(headers=headers, timeout=ADMIN_TIMEOUT_S) as client:
        if args.action == "list":
            r = client.get(base)
        elif args.action == "load":
            r = client.post(base, json={"name": args.name, "path": args.path,
                                        "options": _options(args.option)})
        elif args.action == "swap":
            r = client.put(f"{base}/{args.name}", json={"path": args.path,
                                                        "options": _options(args.option)})
        else:
            r = client.delete(f"{base}/{args.name}")
    return _print(r)
