"""The ingress's choice of deployment (one per served model) for each request, and the lists
of models merged from every deployment's, without a cluster."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from tokenmill.api.errors import APIError  # noqa: E402
from tokenmill.serve_ray.catalog import Catalog, Entry, merge_listings  # noqa: E402
from tokenmill.serve_ray.messages import ModelInfo  # noqa: E402
from tokenmill.server.errors import error_response  # noqa: E402
from tokenmill.server.state import unknown_model  # noqa: E402

CATALOG = Catalog([Entry(ModelInfo("chat", "generate", ("chat-sql",)), "h-chat"),
                   Entry(ModelInfo("small", "generate"), "h-small"),
                   Entry(ModelInfo("minilm", "embed"), "h-embed")])


def _handle(method: str, path: str, body: object = None, catalog: Catalog = CATALOG,
            **query: str) -> object:
    """The handle a request goes to, or the 404 it gets when its model is unknown."""
    raw = json.dumps(body).encode() if body is not None else b""
    target = catalog.target(method, path, query, raw)
    return target.not_found if target.not_found is not None else target.entry.handle


@pytest.mark.parametrize("method, path, body, query, handle", [
    ("POST", "/v1/chat/completions", {"model": "small", "messages": []}, {}, "h-small"),
    ("POST", "/v1/completions", {"model": "chat-sql", "prompt": "x"}, {}, "h-chat"),
    ("POST", "/v1/chat/completions", {"messages": []}, {}, "h-chat"),  # the default
    ("POST", "/v1/embeddings", {"input": "x"}, {}, "h-embed"),  # the task's default
    ("POST", "/v1/embeddings", {"model": "small", "input": "x"}, {}, "h-small"),
    ("POST", "/api/chat", {"model": "small:latest"}, {}, "h-small"),
    ("POST", "/api/embed", {"model": "minilm"}, {}, "h-embed"),
    ("POST", "/v1/messages", {"model": "small"}, {}, "h-small"),
    ("POST", "/tokenize", {"model": "minilm", "prompt": "x"}, {}, "h-embed"),
    ("GET", "/v1/models/small", None, {}, "h-small"),
    ("GET", "/tokenizer_info", None, {"model": "minilm"}, "h-embed"),
    ("GET", "/", None, {}, "h-chat"),
    # A body its server refuses goes to the default, which answers the refusal.
    ("POST", "/v1/chat/completions", "not an object", {}, "h-chat"),
    ("POST", "/api/generate", {"model": ""}, {}, "h-chat"),
])
def test_requests_go_to_their_models_deployment(method: str, path: str, body: object,
                                                query: dict[str, str], handle: str) -> None:
    assert _handle(method, path, body, **query) == handle


@pytest.mark.parametrize("path, name, shown", [
    ("/v1/chat/completions", "nope", "nope"),
    ("/api/chat", "nope:latest", "nope"),  # as Ollama's routes name it
    ("/v1/messages", "nope", "nope"),
    ("/v1/models/nope", "nope", "nope"),
])
def test_an_unknown_model_is_the_single_servers_404(path: str, name: str, shown: str) -> None:
    names = ["chat", "small", "minilm", "chat-sql"]
    assert CATALOG.names() == names
    if path.startswith("/v1/models/"):
        got = _handle("GET", path)
    else:
        got = _handle("POST", path, {"model": name, "messages": []})
    want = error_response(unknown_model(shown, names), path)
    assert got.status_code == 404 and got.body == want.body
    assert isinstance(unknown_model("x", names), APIError)


def test_listings_are_every_models_then_every_adapters() -> None:
    def card(name: str, parent: str | None = None) -> dict:
        return {"id": name, "object": "model", **({"parent": parent} if parent else {})}

    answers = [(200, json.dumps({"object": "list",
                                 "data": [card("chat"), card("chat-sql", "chat")]}).encode()),
               (200, json.dumps({"object": "list", "data": [card("minilm")]}).encode())]
    merged = merge_listings("/v1/models", answers)
    assert merged is not None
    assert json.loads(merged.body) == {"object": "list", "data": [
        card("chat"), card("minilm"), card("chat-sql", "chat")]}
    assert merge_listings("/api/tags", [(200, b'{"models": []}'), (503, b"{}")]) is None


def test_unknown_models_go_to_the_default_which_may_refuse_the_request_first() -> None:
    """A malformed request naming an unknown model is its server's 400 (the default model's
    deployment answers it); the 404 replaces only that server's own 404."""
    body = json.dumps({"model": "nope", "input": "x"}).encode()
    target = CATALOG.target("POST", "/v1/embeddings", {}, body)
    assert target.entry.handle == "h-embed" and target.not_found.status_code == 404


def test_models_dir_names_go_to_the_on_demand_deployment(tmp_path) -> None:
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    catalog = Catalog(CATALOG.entries, on_demand="h-dir", models_dir=str(tmp_path))
    assert _handle("POST", "/v1/completions", {"model": "other.gguf"}, catalog) == "h-dir"
    assert _handle("POST", "/api/generate", {"model": "other.gguf:latest"}, catalog) == "h-dir"
    assert _handle("POST", "/v1/completions", {"model": "small"}, catalog) == "h-small"
    for outside in ("nope.gguf", "../x", str(tmp_path / ".." / "y")):
        assert _handle("POST", "/v1/completions", {"model": outside}, catalog).status_code == 404
