"""`tokenmill pull|list|rm`: models by name in huggingface_hub's local cache, as `ollama
pull|list|rm` keep theirs."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from tokenmill.hub.refs import HubRef, available_quants, gguf_files, parse_hub_ref

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo

REVISION_HELP = ("the branch, tag or commit of a model named on the hub (the same as "
                 "MODEL@REVISION; default: main)")


def add_revision_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--revision`` of the commands that take a model by name."""
    p.add_argument("--revision", default=None, metavar="REV", help=REVISION_HELP)


def add_pull_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill pull`."""
    p = subparsers.add_parser("pull", help="download a model from the Hugging Face hub into "
                              "the local cache",
                              description="Download ORG/NAME (config, safetensors, tokenizer), "
                              "ORG/NAME:QUANT or ORG/NAME/FILE.gguf (a GGUF repo: Q4_K_M or the "
                              "closest quantization when none is named) into huggingface_hub's "
                              "cache (HF_HOME), resuming a broken download. Prints its path.")
    p.add_argument("model", metavar="MODEL", help="ORG/NAME[:QUANT][@REVISION] or "
                   "ORG/NAME/FILE.gguf")
    add_revision_arg(p)
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    """Run `tokenmill pull`: the model's local path on stdout."""
    from tokenmill.hub.download import Hub, fetch

    ref = _ref(args.model, args.revision)
    print(fetch(ref, Hub()))
    return 0


def _ref(model: str, revision: str | None) -> HubRef:
    ref = parse_hub_ref(model, revision)
    if ref is None:
        raise ValueError(f"MODEL {model!r} is not a model name of the Hugging Face hub "
                         "(ORG/NAME, ORG/NAME:QUANT or ORG/NAME/FILE.gguf)")
    return ref


def add_list_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill list`."""
    p = subparsers.add_parser("list", help="the models in the local cache (`tokenmill models "
                              "list`: those of a running server)")
    p.set_defaults(func=cmd_list)


def cmd_list(args: argparse.Namespace) -> int:
    """Run `tokenmill list`: one line per cached revision of each model repo."""
    from huggingface_hub import constants

    rows = [("MODEL", "REVISION", "FILES", "SIZE", "MODIFIED")]
    for repo in _cached_models():
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            names = [str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files]
            rows.append((repo.repo_id, ",".join(sorted(rev.refs)) or rev.commit_hash[:12],
                         _describe(names), _size(rev.size_on_disk), _ago(rev.last_modified)))
    if len(rows) == 1:
        print(f"no models in the cache ({constants.HF_HUB_CACHE}): `tokenmill pull ORG/NAME` "
              "downloads one")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _cached_models() -> list[CachedRepoInfo]:
    """The model repos of huggingface_hub's cache, by name."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def _describe(files: list[str]) -> str:
    """What a cached revision holds: its GGUF quantizations, or a safetensors folder."""
    if gguf_files(files):
        return "gguf " + ",".join(available_quants(files))
    if any(f.endswith(".safetensors") for f in files):
        return "safetensors"
    return f"{len(files)} files"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _ago(timestamp: float) -> str:
    seconds = max(time.time() - timestamp, 0)
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return "just now"


def add_rm_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill rm`."""
    p = subparsers.add_parser("rm", help="remove models from the local cache")
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="ORG/NAME (every cached revision) or ORG/NAME@REVISION")
    p.set_defaults(func=cmd_rm)


def cmd_rm(args: argparse.Namespace) -> int:
    """Run `tokenmill rm`: delete the revisions named, after checking that all are cached."""
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in _cached_models()}
    commits: list[str] = []
    for model in args.models:
        ref = _ref(model, None)
        if ref.quant or ref.filename:
            raise ValueError(f"rm {model!r}: a whole repo or revision is removed, not one "
                             f"file: `tokenmill rm {ref.repo_id}`")
        repo = repos.get(ref.repo_id)
        if repo is None:
            raise ValueError(f"{ref.repo_id} is not in the cache: `tokenmill list` shows what is")
        revs = [r for r in repo.revisions if ref.revision is None
                or ref.revision in r.refs or r.commit_hash.startswith(ref.revision)]
        if not revs:
            raise ValueError(f"{ref.repo_id} has no cached revision {ref.revision!r}")
        commits += [r.commit_hash for r in revs]
    strategy = scan_cache_dir().delete_revisions(*commits)
    strategy.execute()
    for model in args.models:
        print(f"removed {model}")
    print(f"freed {_size(strategy.expected_freed_size)}")
    return 0

