"""LoRA adapters in `tokenmill serve`, as vLLM serves them: adapters named by --lora-modules
answer exactly as PEFT does (completions, chat, streams, Responses, Ollama), beside the base
model and at the same time; /v1/models lists them with their parent; runtime load and unload;
every refusal a clear 4xx that leaves the server serving."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_harness import BASE_ARGS, Server, free_port, start_server

from tokenmill.config import ServerConfig
from tokenmill.engine.args import LoRAModule, parse_lora_module
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.lifecycle import ModelManager
from tokenmill.server.state import ServedModel, ServerState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lora"))

from lora_helpers import PROMPTS, Base, make_adapter, make_base, peft_greedy  # noqa: E402

KEY = "lora-admin"
ADMIN = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 6
# Chat messages render to their own words, so a chat turn is the same prompt as a completion.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@dataclass
class Files:
    """The base model folder, the adapter folders, and PEFT's greedy answers to PROMPTS[i]
    (by adapter name; "base": no adapter)."""

    base: Base
    adapters: dict[str, Path]
    reference: dict[tuple[str, int], list[int]]
    root: Path


def words(ids: list[int]) -> str:
    """Token ids as the word-level tokenizer's text."""
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("lora_server")
    base = make_base(root / "base")
    config_path = base.path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    adapters = {
        "a": make_adapter(base, root / "a", seed=1),
        "b": make_adapter(base, root / "b", seed=2, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj"]),
        "late": make_adapter(base, root / "late", seed=4, r=16, lora_alpha=16,
                             target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    reference = {(name, i): peft_greedy(base, adapters.get(name), PROMPTS[i], MAX_TOKENS)
                 for name in ("base", "a", "b", "late") for i in (0, 1)}
    assert reference[("a", 0)] != reference[("base", 0)]  # else the tests could not fail
    (root / "empty").mkdir()
    return Files(base, adapters, reference, root)


@pytest.fixture(scope="module")
def lora_server(files: Files) -> Iterator[Server]:
    b = {"name": "b", "path": str(files.adapters["b"]), "base_model_name": "base"}
    s = start_server("--model", f"base={files.base.path}", "--max-model-len", "256",
                     "--enable-lora", "--lora-modules", f"a={files.adapters['a']}",
                     json.dumps(b), "--allow-runtime-lora-updating", "--admin-key", KEY)
    yield s
    assert s.stop() == 0, s.log()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def complete(server: Server, model: str, prompt: int = 0) -> tuple[str, list[str]]:
    """The answer's model name and words to PROMPTS[prompt], greedy."""
    r = client(server).completions.create(model=model, prompt=words(PROMPTS[prompt]),
                                          max_tokens=MAX_TOKENS, temperature=0)
    return r.model, r.choices[0].text.split()


def expected(files: Files, name: str, prompt: int = 0) -> list[str]:
    return words(files.reference[(name, prompt)]).split()


def post(server: Server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers or ADMIN, timeout=60)


def assert_serving(server: Server, files: Files) -> None:
    """The server still answers, through an adapter and through the base."""
    assert complete(server, "a") == ("a", expected(files, "a"))
    assert complete(server, "base") == ("base", expected(files, "base"))


# ------------------------------------------------------------------ serving adapters


def test_models_lists_adapters_with_their_parent_and_root(lora_server: Server,
                                                         files: Files) -> None:
    models = {m.id: m.model_extra for m in client(lora_server).models.list().data}
    assert set(models) == {"base", "a", "b"}
    assert "parent" not in models["base"] and "root" not in models["base"]
    assert models["a"]["parent"] == "base" and models["a"]["root"] == str(files.adapters["a"])
    assert models["b"]["parent"] == "base" and models["b"]["root"] == str(files.adapters["b"])
    one = client(lora_server).models.retrieve("b")
    assert one.id == "b" and one.model_extra["parent"] == "base"


def test_each_adapter_answers_as_peft_does(lora_server: Server, files: Files) -> None:
    for name in ("a", "b", "base"):
        for prompt in (0, 1):
            assert complete(lora_server, name, prompt) == (name, expected(files, name, prompt))


def test_an_adapter_and_the_base_at_the_same_time(lora_server: Server, files: Files) -> None:
    asks = [("a", 0), ("base", 1), ("b", 1), ("base", 0)]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: complete(lora_server, *ask), asks))
    assert answers == [(name, expected(files, name, prompt)) for name, prompt in asks]


def test_chat_and_streams_through_an_adapter(lora_server: Server, files: Files) -> None:
    want = expected(files, "a")
    messages = [{"role": "user", "content": words(PROMPTS[0])}]
    chat = client(lora_server).chat.completions.create(
        model="a", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.model == "a" and chat.choices[0].message.content.split() == want
    stream = client(lora_server).completions.create(
        model="a", prompt=words(PROMPTS[0]), max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].text for c in chunks if c.choices).split() == want
    stream = client(lora_server).chat.completions.create(
        model="a", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"a"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == want


def test_responses_and_ollama_run_the_adapter(lora_server: Server, files: Files) -> None:
    want = expected(files, "b")
    r = post(lora_server, "/v1/responses", {"model": "b", "input": words(PROMPTS[0]),
                                            "max_output_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "b" and body["output"][0]["content"][0]["text"].split() == want
    r = post(lora_server, "/api/generate", {
        "model": "b", "prompt": words(PROMPTS[0]), "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": MAX_TOKENS}})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "b" and r.json()["response"].split() == want
    for listing in ("/api/tags", "/api/ps"):  # adapters are models of their own, as in Ollama
        names = [m["name"] for m in httpx.get(f"{lora_server.url}{listing}").json()["models"]]
        assert {"base", "a", "b"} <= set(names), listing


def test_embeddings_with_an_adapter_name_is_a_400(lora_server: Server, files: Files) -> None:
    r = post(lora_server, "/v1/embeddings", {"model": "a", "input": "t5 t9"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model" and "'a' is a LoRA adapter of 'base'" in error["message"]
    assert_serving(lora_server, files)


def test_the_admin_api_keeps_a_base_that_adapters_run_on(lora_server: Server,
                                                         files: Files) -> None:
    r = httpx.delete(f"{lora_server.url}/admin/models/base", headers=ADMIN, timeout=30)
    assert r.status_code == 409 and "'a', 'b'" in r.json()["error"]["message"]
    r = httpx.delete(f"{lora_server.url}/admin/models/a", headers=ADMIN, timeout=30)
    assert r.status_code == 400 and "/v1/unload_lora_adapter" in r.json()["error"]["message"]
    assert_serving(lora_server, files)


# ------------------------------------------------------------------ loading at runtime


def test_load_use_and_unload_at_runtime(lora_server: Server, files: Files) -> None:
    path = str(files.adapters["late"])
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert r.status_code == 200, r.text
    cards = {m.id: m.model_extra for m in client(lora_server).models.list().data}
    assert cards["late"]["parent"] == "base" and cards["late"]["root"] == path
    assert complete(lora_server, "late", 1) == ("late", expected(files, "late", 1))
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late", "lora_int_id": 3})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        complete(lora_server, "late")
    assert "'late' does not exist" in e.value.message
    assert "late" not in {m.id for m in client(lora_server).models.list().data}
    # Loaded again (a new id): the same answers.
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path,
                                                    "base_model_name": "base"})
    assert r.status_code == 200, r.text
    assert complete(lora_server, "late", 1) == ("late", expected(files, "late", 1))
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


@pytest.mark.parametrize("body, status, param, words_in_message", [
    ({"lora_name": "x", "lora_path": "{empty}"}, 400, "lora_path", "adapter_config.json"),
    ({"lora_name": "x", "lora_path": "{root}/nowhere"}, 400, "lora_path", "not a directory"),
    ({"lora_name": "a", "lora_path": "{late}"}, 400, "lora_name", "already loaded"),
    ({"lora_name": "base", "lora_path": "{late}"}, 400, "lora_name", "served model"),
    ({"lora_name": "x", "lora_path": "{late}", "base_model_name": "nope"}, 404,
     "base_model_name", "'nope' is not a served model"),
    ({"lora_name": "x"}, 400, None, "lora_path"),
    ({"lora_name": "x", "lora_path": "{late}", "load_inplace": True}, 400, None,
     "load_inplace"),
])
def test_a_bad_load_is_refused_and_the_server_serves_on(
        lora_server: Server, files: Files, body: dict, status: int, param: str | None,
        words_in_message: str) -> None:
    paths = {"empty": files.root / "empty", "root": files.root, "late": files.adapters["late"]}
    body = {k: v.format(**paths) if isinstance(v, str) else v for k, v in body.items()}
    r = post(lora_server, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words_in_message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert "x" not in {m.id for m in client(lora_server).models.list().data}
    assert_serving(lora_server, files)


@pytest.mark.parametrize("name, status, words_in_message", [
    ("nope", 404, "no LoRA adapter named 'nope'"),
    ("base", 400, "'base' is a served model, not a LoRA adapter"),
])
def test_a_bad_unload_is_refused_and_the_server_serves_on(
        lora_server: Server, files: Files, name: str, status: int,
        words_in_message: str) -> None:
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": name})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_name" and words_in_message in error["message"]
    assert_serving(lora_server, files)


def test_runtime_loading_takes_the_admin_key(lora_server: Server) -> None:
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a"},
             headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    assert "a" in {m.id for m in client(lora_server).models.list().data}


# ------------------------------------------------------------------ start-up


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`tokenmill serve` expected to refuse to start."""
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(free_port()), *BASE_ARGS,
           "--max-model-len", "256", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_lora_modules_need_enable_lora(files: Files) -> None:
    done = serve("--model", f"base={files.base.path}", "--lora-modules",
                 f"a={files.adapters['a']}")
    assert done.returncode == 2
    assert "--lora-modules needs --enable-lora" in done.stderr
    done = serve("--model", f"base={files.base.path}", "--allow-runtime-lora-updating")
    assert done.returncode == 2
    assert "--allow-runtime-lora-updating needs --enable-lora" in done.stderr


def test_a_bad_adapter_folder_fails_the_start(files: Files) -> None:
    done = serve("--model", f"base={files.base.path}", "--enable-lora", "--lora-modules",
                 f"a={files.adapters['a']}", f"broken={files.root / 'empty'}")
    assert done.returncode == 2
    assert "--lora-modules broken:" in done.stderr and "adapter_config.json" in done.stderr


def test_an_adapter_named_like_a_model_fails_the_start(files: Files) -> None:
    done = serve("--model", f"base={files.base.path}", "--enable-lora", "--lora-modules",
                 f"base={files.adapters['a']}")
    assert done.returncode == 2
    assert "--lora-modules base: 'base' is the name of a served model" in done.stderr


def test_lora_module_values() -> None:
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') \
        == LoRAModule("a", "/x", "m")
    for bad, why in [("a", "NAME=PATH"), ("=/x", "name must"), ("a=", "path must"),
                     ('{"name": "a"}', "path must"), ("{oops", "not valid JSON"),
                     ('{"name": "a", "path": "/x", "rank": 8}', "unknown key 'rank'"),
                     ('{"name": "a", "path": "/x", "base_model_name": 3}', "base_model_name")]:
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)


# ------------------------------------------------------------------ who may load


def app_client(**config: object) -> TestClient:
    """The app over one fake text-generation model without adapters."""
    fake = SimpleNamespace(num_seqs_in_flight=0, engine=SimpleNamespace(lora_enabled=False))
    state = ServerState(ServerConfig(allowed_hosts=("*",), **config),
                        {"m": ServedModel("m", fake)}, PrometheusMetrics())  # type: ignore[arg-type]
    manager = ModelManager(state, make_config=lambda spec: spec)  # type: ignore[arg-type]
    return TestClient(build_app(state, manager))


def test_runtime_loading_is_off_without_its_flag() -> None:
    r = app_client().post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


@pytest.mark.parametrize("keys, refused, allowed", [
    ({"api_key": "user"}, "nothing", "user"),
    ({"api_key": "user", "admin_key": "admin"}, "user", "admin"),
])
def test_runtime_loading_takes_the_admin_key_else_the_api_key(
        keys: dict[str, str], refused: str, allowed: str) -> None:
    http = app_client(allow_runtime_lora_updating=True, **keys)

    def load(key: str) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", headers={"Authorization": f"Bearer {key}"},
                         json={"lora_name": "a", "lora_path": "/x"})

    assert load(refused).status_code == 401
    r = load(allowed)  # past the key: the fake model runs no adapters
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_runtime_paths_stay_inside_models_dir(tmp_path: Path) -> None:
    """With --models-dir, an adapter loads from inside it only, as a model does."""
    http = app_client(allow_runtime_lora_updating=True, models_dir=str(tmp_path))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "../elsewhere"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "lora_path"
    assert "not found in the models folder" in r.json()["error"]["message"]
    (tmp_path / "inside").mkdir()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "inside"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_enable_lora_is_for_the_generating_models(files: Files) -> None:
    """The default server serves an embedding model beside the chat model: the command line's
    --enable-lora goes to the chat model only; a model's own enable-lora option is kept."""
    from tokenmill.cli import build_parser
    from tokenmill.server.model_registry import served_models

    args = build_parser().parse_args(["serve", "--enable-lora", "--kv-cache-memory", "1000000"])
    chat, embed = (config for _, config in served_models(args))
    assert chat.lora.enable_lora and not embed.lora.enable_lora
    args = build_parser().parse_args(
        ["serve", "--kv-cache-memory", "1000000", "--model", f"b={files.base.path},enable-lora",
         "--model", f"e={files.base.path},task=embed,enable-lora"])
    assert [config.lora.enable_lora for _, config in served_models(args)] == [True, True]
