"""Fetch a model by name into huggingface_hub's cache and give its local path.

huggingface_hub does the work: its cache (``HF_HOME`` / ``HF_HUB_CACHE``), ``HF_TOKEN``,
``HF_ENDPOINT`` (a mirror, or the tests' stand-in hub), ``HF_HUB_OFFLINE``, resumable downloads
with a progress bar. This module picks the files (the safetensors folder, or one GGUF
quantization with every shard of a split file), works from the cache when the hub cannot be
reached, and turns the hub's errors into ValueErrors that say what to do.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from tokenmill.hub.refs import HubRef, available_quants, parse_hub_ref, pick_gguf

# The files of a Hugging Face folder the loaders read: config, safetensors (and their index),
# tokenizer, chat template, sentence-transformers pooling; other weight formats stay behind.
FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]


@dataclass(frozen=True)
class Hub:
    """Where to fetch from and keep models; None: huggingface_hub's defaults (its cache,
    ``HF_ENDPOINT``, ``HF_TOKEN``)."""

    endpoint: str | None = None
    cache_dir: str | None = None
    token: str | None = None

    def endpoint_url(self) -> str:
        from huggingface_hub import constants

        return (self.endpoint or constants.ENDPOINT).rstrip("/")

    def cache_path(self) -> str:
        from huggingface_hub import constants

        return self.cache_dir or constants.HF_HUB_CACHE


def resolve_model(model: str, revision: str | None = None, hub: Hub | None = None) -> str:
    """The local path of ``model``: the path itself when it exists, else the hub reference
    downloaded (or found in the cache); ValueError when it is neither."""
    if os.path.exists(model):
        if revision is not None:
            raise ValueError(f"--revision {revision!r} is for a model named on the hub, not "
                             f"for the local path {model!r}")
        return model
    ref = parse_hub_ref(model, revision)
    if ref is None:
        raise ValueError(f"model {model!r} is neither a GGUF file or Hugging Face folder on "
                         "disk nor a Hugging Face repo (ORG/NAME, ORG/NAME:QUANT or "
                         "ORG/NAME/FILE.gguf)")
    return fetch(ref, hub or Hub())


def fetch(ref: HubRef, hub: Hub) -> str:
    """Download what ``ref`` names (files already cached are not fetched again) and return the
    GGUF file's or the folder's path in the cache."""
    files, online = _listing(ref, hub)
    ggufs: list[str] = []
    if ref.quant or ref.filename or not _is_folder(files):
        try:
            ggufs = pick_gguf(ref, files)
        except ValueError:
            if online:
                raise
            # Offline, the listing is what the cache holds, not what the repo has.
            held = ", ".join(available_quants(files)) or "no GGUF file"
            raise _offline_error(ConnectionError(), ref, hub, f", which holds {held}") from None
    folder = _snapshot(ref, hub, ggufs or FOLDER_PATTERNS, online)
    return os.path.join(folder, ggufs[0]) if ggufs else folder


def _is_folder(files: list[str]) -> bool:
    """Whether a repo is a Hugging Face model folder (config and safetensors weights)."""
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def _listing(ref: HubRef, hub: Hub) -> tuple[list[str], bool]:
    """The repo's files at the revision and whether the hub answered; offline, the files of
    the cached snapshot."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    try:
        # model_info, not list_repo_tree: the latter retries a refused connection for ~30 s.
        info = api.model_info(ref.repo_id, revision=ref.revision)
        return [s.rfilename for s in info.siblings or []], True
    except Exception as e:
        if not _is_network_error(e) and not _is_server_error(e):
            raise _user_error(e, ref, hub) from None
        cached = _cached_files(ref, hub)
        if cached is None:
            raise _offline_error(e, ref, hub) from None
        return cached, False


def _cached_files(ref: HubRef, hub: Hub) -> list[str] | None:
    """The files of the revision's snapshot in the cache, or None if it has none."""
    from huggingface_hub.file_download import repo_folder_name

    repo = os.path.join(hub.cache_path(), repo_folder_name(repo_id=ref.repo_id,
                                                           repo_type="model"))
    commit = ref.revision or "main"
    ref_file = os.path.join(repo, "refs", commit)
    if os.path.isfile(ref_file):
        with open(ref_file, encoding="utf-8") as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit)
    if not os.path.isdir(snapshot):
        return None
    return sorted(os.path.relpath(os.path.join(d, n), snapshot).replace(os.sep, "/")
                  for d, _, names in os.walk(snapshot) for n in names)


def _snapshot(ref: HubRef, hub: Hub, patterns: list[str], online: bool) -> str:
    """snapshot_download of the files matching ``patterns``; the snapshot folder."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=patterns,
                                 cache_dir=hub.cache_dir, endpoint=hub.endpoint,
                                 token=hub.token, local_files_only=not online)
    except Exception as e:
        if _is_network_error(e) or _is_not_cached(e):
            raise _offline_error(e, ref, hub) from None
        raise _user_error(e, ref, hub) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the hub could not be reached (the HTTP library's transport
    errors, whichever huggingface_hub uses, and its own offline mode)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            lib = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(lib, n) for n in ("TransportError", "ConnectionError", "Timeout")
                   if isinstance(getattr(lib, n, None), type)]
    return tuple(errors)


def _is_network_error(e: BaseException) -> bool:
    return isinstance(e, _network_errors())


def _is_server_error(e: BaseException) -> bool:
    """The hub is down (5xx): what is in the cache still serves."""
    from huggingface_hub.errors import HfHubHTTPError

    response = e.response if isinstance(e, HfHubHTTPError) else None
    return response is not None and response.status_code >= 500


def _is_not_cached(e: BaseException) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(e, LocalEntryNotFoundError)


def _offline_error(e: BaseException, ref: HubRef, hub: Hub, cached: str = "") -> ValueError:
    """No network (or HF_HUB_OFFLINE) and not in the cache: say so, and how to work offline."""
    from huggingface_hub import constants

    where = f"the local cache ({hub.cache_path()}){cached}"
    if constants.HF_HUB_OFFLINE:
        return ValueError(f"{ref} is not in {where} and HF_HUB_OFFLINE is set: unset it to "
                          f"download from {hub.endpoint_url()}, or run `tokenmill pull {ref}` "
                          "on a machine with network and copy the cache (HF_HOME)")
    return ValueError(f"cannot reach {hub.endpoint_url()} ({type(e).__name__}) and {ref} is "
                      f"not in {where}. Connect (HF_ENDPOINT names a mirror), or run "
                      f"`tokenmill pull {ref}` while online; models in the cache then work "
                      "without network (HF_HUB_OFFLINE=1 never tries it)")


def _user_error(e: BaseException, ref: HubRef, hub: Hub) -> BaseException:
    """The hub's refusal as a ValueError that names the repo and the way out; anything else
    unchanged."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = f"{hub.endpoint_url()}/{ref.repo_id}"
    if isinstance(e, GatedRepoError):
        return ValueError(f"{ref.repo_id} is a gated repo: accept its conditions at {url} and "
                          "set HF_TOKEN to an access token of that account "
                          f"({'the token given has no access' if _has_token(hub) else 'none is set'})")
    if isinstance(e, RepositoryNotFoundError):
        return ValueError(f"model {str(ref)!r}: no such file or folder here, and no repo "
                          f"{ref.repo_id} on {hub.endpoint_url()} (a private repo needs "
                          "HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return ValueError(f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or "
                          "commit)")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "an error"
        return ValueError(f"{hub.endpoint_url()} answered {status} for {ref}: "
                          f"{str(e).splitlines()[0]}")
    return e


def _has_token(hub: Hub) -> bool:
    from huggingface_hub import get_token

    return bool(hub.token or get_token())

