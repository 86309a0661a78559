"""Which deployment answers a request: the ingress's table of the served models (one
deployment each, with its LoRA adapters), the model a request names (its body's ``model``,
the path of ``/v1/models/{id}``, ``?model=`` of ``/tokenizer_info``), and the merged answers
of the routes that list every model (``/v1/models``, ``/api/tags``, ``/api/ps``). With
--models-dir a name of that folder goes to the deployment whose replicas load such models on
demand.

Plain Python: no Ray here (a deployment's handle is an opaque ``handle``), so the choices are
unit-tested without a cluster. A name no deployment serves is the single server's 404
(``unknown_model``), with the body of the route's API (OpenAI, Ollama or Anthropic).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from tokenmill.api.errors import APIError
from tokenmill.serve_ray.messages import ModelInfo
from tokenmill.server.errors import error_response, is_ollama_path
from tokenmill.server.models_dir import path_inside
from tokenmill.server.state import EMBED, GENERATE, unknown_model

# Routes whose JSON body's ``model`` names the model that answers (none: the first model of
# the route's task), by task (None: a model of any task).
MODEL_ROUTES: dict[str, str | None] = {
    **dict.fromkeys(("/v1/chat/completions", "/v1/completions", "/v1/responses",
                     "/v1/classify", "/v1/messages", "/v1/messages/count_tokens",
                     "/api/chat", "/api/generate"), GENERATE),
    **dict.fromkeys(("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank",
                     "/v2/rerank", "/api/embed", "/api/embeddings"), EMBED),
    **dict.fromkeys(("/tokenize", "/detokenize", "/api/show"), None),
}
# Routes that list every model: the key of their JSON list.
LISTING_ROUTES = {"/v1/models": "data", "/api/tags": "models", "/api/ps": "models"}
MODEL_CARD_PREFIX = "/v1/models/"


@dataclass(frozen=True)
class Entry:
    """One served model: what its deployment said of it, and the deployment's handle."""

    info: ModelInfo
    handle: Any


@dataclass(frozen=True)
class Target:
    """Where a request goes: ``entry``'s deployment. ``not_found``: the request names no
    served model; its answer unless ``entry`` (the default) refuses the request first (a
    malformed request is a 400 before its model is looked up, as on one server)."""

    entry: Entry
    not_found: JSONResponse | None = None


class Catalog:
    """The served models, in the order they were named (the first of a task: its default);
    with ``on_demand`` (--models-dir) the deployment that loads the models of ``models_dir``
    a request names."""

    def __init__(self, entries: Sequence[Entry], on_demand: Any = None,
                 models_dir: str | None = None) -> None:
        self.entries = list(entries)
        self.on_demand = Entry(ModelInfo("", "on_demand"), on_demand) if on_demand else None
        self.models_dir = os.path.realpath(models_dir) if models_dir else None

    def names(self) -> list[str]:
        """The names a server lists: every model, then every adapter."""
        return ([e.info.name for e in self.entries]
                + [a for e in self.entries for a in e.info.adapters])

    def find(self, name: str, ollama: bool = False) -> Entry | None:
        """The entry serving ``name`` (a model's or an adapter's; Ollama's ``name:latest``
        is ``name``)."""
        for entry in self.entries:
            if name == entry.info.name or name in entry.info.adapters:
                return entry
        if ollama and name.endswith(":latest"):
            return self.find(name.removesuffix(":latest"))
        return None

    def default(self, task: str | None = GENERATE) -> Entry:
        """The first model of ``task`` (else the first: its server answers the wrong-task
        error as one server does)."""
        return next((e for e in self.entries if task is None or e.info.task == task),
                    self.entries[0])

    def target(self, method: str, path: str, query: dict[str, str], body: bytes) -> Target:
        """The deployment for a request (see the module's docstring)."""
        if method == "GET" and path.startswith(MODEL_CARD_PREFIX):
            return self._named(path[len(MODEL_CARD_PREFIX):], path, None)
        if method == "GET" and path == "/tokenizer_info" and "model" in query:
            return self._named(query["model"], path, None)
        if method != "POST" or path not in MODEL_ROUTES:
            return Target(self.default())
        task = MODEL_ROUTES[path]
        name = _body_model(body)
        if not name:  # no model named (or a body its server refuses)
            return Target(self.default(task))
        return self._named(name, path, task)

    def _named(self, name: str, path: str, task: str | None) -> Target:
        ollama = is_ollama_path(path)
        entry = self.find(name, ollama)
        if entry is not None:
            return Target(entry)
        # As Ollama's routes do: an unknown "x:latest" is "x".
        shown = name.removesuffix(":latest") if ollama else name
        if self.on_demand is not None and self._in_models_dir(shown):
            return Target(self.on_demand)
        return Target(self.default(task),
                      error_response(unknown_model(shown, self.names()), path))

    def _in_models_dir(self, name: str) -> bool:
        """Whether ``name`` is a file or folder of --models-dir (as its server checks)."""
        try:
            path_inside(self.models_dir, name, "model")
        except APIError:
            return False
        return True


def _body_model(body: bytes) -> str | None:
    """The ``model`` a JSON body names (None: none, or no JSON object)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def merge_listings(path: str, answers: Sequence[tuple[int, bytes]]) -> JSONResponse | None:
    """One server's answer to a listing route from each deployment's (status, body): every
    model, then every adapter (each deployment lists its model first); None when one failed
    (its answer is then returned as it is)."""
    key = LISTING_ROUTES[path]
    bodies = []
    for status, raw in answers:
        if status != 200:
            return None
        bodies.append(json.loads(raw))
    items = [b[key][0] for b in bodies if b[key]] + [i for b in bodies for i in b[key][1:]]
    return JSONResponse({**bodies[0], key: items})
