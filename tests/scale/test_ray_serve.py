"""`tokenmill serve --replicas 2` on a local Ray (kept on 127.0.0.1): a deployment of two
replicas for each served model (the embedded chat model with a small KV cache, a tiny random
Llama with a LoRA adapter, the embedded embedding model) behind the ingress, against one
in-process server of the same models.

Answers equal a single server's; requests go to their model's deployment (an unknown model is
the single server's 404); requests sharing a long prefix land on one replica and hit its
prefix cache; the router learns where a prefix is cached from the replicas' KV-cache events;
unrelated prompts spread over both; a replica killed with ``ray.kill`` loses no request that
had not started."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

# A local Ray cluster and engines: minutes on a small machine (in the default run all the same).
pytestmark = pytest.mark.slow

from tokenmill.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from tokenmill.engine.args import LoRAModule, add_engine_args  # noqa: E402
from tokenmill.serve_ray.app import REPLICA_DEPLOYMENT, ScaleConfig, build_application  # noqa: E402
from tokenmill.serve_ray.messages import REPLICA_HEADER  # noqa: E402

SYSTEM = ("You are the support assistant of a hardware shop. Answer in one short sentence, "
          "politely, and never invent prices or stock levels. ") * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config() -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=1024),
                        cache=CacheConfig(num_blocks=96, block_size=16),
                        scheduler=SchedulerConfig(max_num_seqs=4),
                        device=DeviceConfig(num_threads=1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random Llama folder and a PEFT adapter of it (the LoRA tests' helpers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lora"))
    from lora_helpers import make_adapter, make_base

    root = tmp_path_factory.mktemp("ray_lora")
    base = make_base(root / "models" / "base")  # also the one model of --models-dir
    return base.path, make_adapter(base, root / "sql", seed=3)


@pytest.fixture(scope="module")
def served(tiny: tuple[Path, Path]) -> list[tuple[str | None, EngineConfig]]:
    """The embedded chat model, the tiny Llama as "tiny" (adapters on), and the embedded
    embedding model."""
    embed = EngineConfig(model=ModelConfig(task="embed", max_model_len=256),
                         device=DeviceConfig(num_threads=1))
    small = EngineConfig(model=ModelConfig(model=str(tiny[0]), max_model_len=256),
                         cache=CacheConfig(num_blocks=32, block_size=16),
                         lora=LoRAConfig(enable_lora=True), device=DeviceConfig(num_threads=1))
    return [(None, engine_config()), ("tiny", small), (None, embed)]


@pytest.fixture(scope="module")
def adapters(tiny: tuple[Path, Path]) -> list[LoRAModule]:
    return [LoRAModule("tiny-sql", str(tiny[1]), base_model_name="tiny")]


@pytest.fixture(scope="module")
def server_config(tiny: tuple[Path, Path]) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=_free_port(), models_dir=str(tiny[0].parent))


def engine_args() -> argparse.Namespace:
    """The command line's engine options, for the models --models-dir loads on demand."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(["--max-model-len", "256", "--threads", "1"])


@pytest.fixture(scope="module")
def cluster(server_config: ServerConfig, served: list, adapters: list) -> Iterator[str]:
    """Two replicas of each model on a local Ray; the ingress's base URL."""
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                            "OMP_NUM_THREADS")}
    # Keeps the local Ray on 127.0.0.1 (--node-ip-address alone does not).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["OMP_NUM_THREADS"] = "1"
    # Logical CPUs: 8 replicas and the faulty application's one.
    ray.init(num_cpus=10, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": server_config.port})
        app = build_application(served, server_config,
                                ScaleConfig(replicas=2, replica_cpus=1.0), adapters,
                                engine_args())
        serve.run(app, name="tokenmill", route_prefix="/")
        yield f"http://127.0.0.1:{server_config.port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def single(server_config: ServerConfig, served: list, adapters: list
           ) -> Iterator[httpx.Client]:
    """One in-process server (`tokenmill serve`'s application) to compare with."""
    from fastapi.testclient import TestClient

    from tokenmill.server.app import build_app
    from tokenmill.server.launcher import load_models
    from tokenmill.server.lifecycle import ModelManager
    from tokenmill.server.lora_adapters import load_lora_modules
    from tokenmill.server.model_registry import config_factory

    state = load_models(served, server_config)
    load_lora_modules(state, adapters)
    factory = config_factory(engine_args())
    manager = ModelManager(state, factory, server_config.models_dir, budget=factory.budget)
    with TestClient(build_app(state, manager), base_url="http://127.0.0.1") as client:
        yield client


def chat(prompt: str, system: str = SYSTEM, **extra: object) -> dict:
    return {"messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": prompt}],
            "max_tokens": 6, "temperature": 0.0, **extra}


def _answer(body: dict) -> tuple:
    return (body["choices"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])


def test_answers_equal_a_single_servers(cluster: str, single: httpx.Client) -> None:
    with httpx.Client(base_url=cluster, timeout=300) as client:
        req = chat("Do you sell soldering irons?")
        got, want = client.post("/v1/chat/completions", json=req), single.post(
            "/v1/chat/completions", json=req)
        assert got.status_code == want.status_code == 200
        assert got.headers[REPLICA_HEADER]
        assert _answer(got.json()) == _answer(want.json())
        comp = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0}
        got, want = client.post("/v1/completions", json=comp), single.post(
            "/v1/completions", json=comp)
        assert got.json()["choices"] == want.json()["choices"]
        # A streamed answer: the same events, ids and timestamps aside.
        stream = {**req, "stream": True}
        got_text = client.post("/v1/chat/completions", json=stream).text
        want_text = single.post("/v1/chat/completions", json=stream).text
        assert _deltas(got_text) == _deltas(want_text) and got_text.endswith("data: [DONE]\n\n")
        # Errors are the same bytes.
        bad = {"messages": [], "max_tokens": -1}
        got, want = client.post("/v1/chat/completions", json=bad), single.post(
            "/v1/chat/completions", json=bad)
        assert (got.status_code, got.content) == (want.status_code, want.content)
        assert client.get("/health").json() == single.get("/health").json()
        model = single.get("/v1/models").json()["data"][0]["id"]
        assert client.get("/v1/models").json()["data"][0]["id"] == model
        ollama = {"model": model, "prompt": "Hi", "stream": False,
                  "options": {"temperature": 0, "num_predict": 4}}
        got, want = client.post("/api/generate", json=ollama), single.post(
            "/api/generate", json=ollama)
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["response"] == want.json()["response"]
        embed = {"input": ["hello", "a shop that sells cables"]}
        got, want = client.post("/v1/embeddings", json=embed), single.post(
            "/v1/embeddings", json=embed)
        assert got.status_code == want.status_code == 200
        assert got.content == want.content


def _deltas(sse: str) -> list[str]:
    import json

    out = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return out


def test_shared_prefix_lands_on_one_replica(cluster: str) -> None:
    with httpx.Client(base_url=cluster, timeout=300) as client:
        replicas, cached = set(), []
        for question in ["Do you open on Sunday?", "Where is the shop?", "Any discounts?",
                         "Can I return a cable?"]:
            r = client.post("/v1/chat/completions", json=chat(question))
            assert r.status_code == 200
            replicas.add(r.headers[REPLICA_HEADER])
            cached.append(r.json()["usage"].get("prompt_tokens_details", {})
                          .get("cached_tokens", 0))
        assert len(replicas) == 1
        assert all(c >= 64 for c in cached[1:]), cached


def test_unrelated_prompts_spread(cluster: str) -> None:
    with httpx.Client(base_url=cluster, timeout=300) as client:
        seen = set()
        for i in range(6):
            system = f"Topic {i}: " + " ".join(f"w{i}x{j}" for j in range(40))
            r = client.post("/v1/chat/completions", json=chat("Go on.", system=system))
            assert r.status_code == 200
            seen.add(r.headers[REPLICA_HEADER])
        assert len(seen) == 2


def _content(r: httpx.Response) -> tuple[int, bytes]:
    return r.status_code, r.content


def test_each_model_is_a_deployment_routed_by_name(cluster: str, single: httpx.Client) -> None:
    """Each model answers from its own replicas, as the single server answers; the lists of
    models are every deployment's; an unknown model is the single server's 404."""
    with httpx.Client(base_url=cluster, timeout=300) as client:
        want = [m["id"] for m in single.get("/v1/models").json()["data"]]
        got = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in got] == want and want[1:] == ["tiny", want[2], "tiny-sql"]
        assert got[-1]["parent"] == "tiny"
        assert ([m["name"] for m in client.get("/api/tags").json()["models"]]
                == [m["name"] for m in single.get("/api/tags").json()["models"]])
        seen: dict[str, set[str]] = {}
        for model in ("tiny", "tiny-sql", want[0]):
            req = {"model": model, "prompt": "t5 t9 t33 t100 t7", "max_tokens": 4,
                   "temperature": 0.0}
            for _ in range(3):
                r = client.post("/v1/completions", json=req)
                assert r.json()["choices"] == single.post("/v1/completions",
                                                          json=req).json()["choices"]
                seen.setdefault(model, set()).add(r.headers[REPLICA_HEADER])
        # The adapter runs on its base model's replicas; each model on its own.
        tiny, main = _replicas_of(cluster, "tiny"), _replicas_of(cluster, want[0])
        assert len(tiny) == len(main) == 2 and not tiny & main
        assert seen["tiny"] | seen["tiny-sql"] <= tiny and seen[want[0]] <= main
        embed = {"model": want[2], "input": ["cables"]}
        got_e, want_e = client.post("/v1/embeddings", json=embed), single.post(
            "/v1/embeddings", json=embed)
        assert got_e.content == want_e.content
        assert got_e.headers[REPLICA_HEADER] in _replicas_of(cluster, want[2]) - tiny - main
        for method, path, body in [
                ("POST", "/v1/chat/completions", {"model": "nope", **chat("Hi")}),
                ("POST", "/api/chat", {"model": "nope:latest", "stream": False,
                                       "messages": [{"role": "user", "content": "Hi"}]}),
                # Malformed: its server's 400 before any model is looked up.
                ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}),
                ("POST", "/v1/messages", {"model": "nope", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Hi"}]}),
                ("GET", "/v1/models/nope", None)]:
            got_r = client.request(method, path, json=body)
            want_r = single.request(method, path, json=body)
            assert got_r.status_code in (400, 404) and _content(got_r) == _content(want_r), path
        # The next request is answered as before.
        assert client.post("/v1/chat/completions", json=chat("After.")).status_code == 200


def test_models_dir_models_load_on_demand(cluster: str, single: httpx.Client) -> None:
    """A model of --models-dir a request names is loaded by the replicas kept for such
    models and answers as one server answers; a name outside the folder is a 404."""
    with httpx.Client(base_url=cluster, timeout=300) as client:
        req = {"model": "base", "prompt": "t5 t9 t33 t100 t7", "max_tokens": 4,
               "temperature": 0.0}
        got, want = client.post("/v1/completions", json=req), single.post(
            "/v1/completions", json=req)
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["choices"] == want.json()["choices"]
        assert got.json()["model"] == "base"
        ids = [m["id"] for m in single.get("/v1/models").json()["data"]]
        started = set().union(*(_replicas_of(cluster, m) for m in ids[:3]))
        assert got.headers[REPLICA_HEADER] not in started
        missing = client.post("/v1/completions", json={**req, "model": "../sql"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


def _replicas_of(cluster: str, model: str) -> set[str]:
    """The replicas whose /metrics (labelled by replica) report ``model``."""
    for _ in range(100):  # each replica posts its numbers every second
        text = httpx.get(f"{cluster}/metrics", timeout=60).text
        found = set(re.findall(rf'model_name="{re.escape(model)}"[^}}]*replica="([^"]+)"',
                               text))
        if len(found) == 2:
            return found
        time.sleep(0.2)
    return found


def test_router_learns_prefixes_from_kv_events(cluster: str) -> None:
    """A prompt sent as token ids carries no route key: the router cannot guess where it
    went, only the replica's KV-cache events tell it. The same prompt as text then lands on
    that replica and hits its prefix cache, every time."""
    with httpx.Client(base_url=cluster, timeout=300) as client:
        for i in range(4):
            text = f"Story {i}: " + " ".join(f"w{i}y{j}" for j in range(50))
            ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
            first = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                                          "temperature": 0.0})
            assert first.status_code == 200
            time.sleep(1)  # the events travel (milliseconds on one machine)
            again = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1,
                                                          "temperature": 0.0})
            assert again.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER], i
            details = again.json()["usage"].get("prompt_tokens_details") or {}
            assert details.get("cached_tokens", 0) >= 48


def test_metrics_of_every_replica(cluster: str) -> None:
    """/metrics: every replica's samples, labelled by replica; ?replica=NAME: its own."""
    with httpx.Client(base_url=cluster, timeout=300) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        # Two replicas of each of the three models (a --models-dir replica that has loaded
        # nothing has no samples).
        started = set().union(*(_replicas_of(cluster, m) for m in ids[:3]))
        assert len(started) == 6
        text = client.get("/metrics").text
        names = set(re.findall(r'replica="([^"]+)"', text))
        assert started <= names, text[:500]
        assert re.search(r'tokenmill:prefix_cache_hits_total\{[^}]*replica=', text)
        one = client.get("/metrics", params={"replica": sorted(names)[0]})
        assert one.status_code == 200 and "tokenmill:prefix_cache_hits" in one.text
        assert 'replica="' not in one.text
        missing = client.get("/metrics", params={"replica": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "replica"


def test_killed_replica_loses_no_request(cluster: str) -> None:
    """Requests sent while a replica is killed are all answered: those that had not started
    there (no answer had begun) are sent to the other; the next request is answered too."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster, timeout=300) as client:
            first = await client.post("/v1/chat/completions", json=chat("Warm up."))
            victim = first.headers[REPLICA_HEADER]
            batch = [asyncio.ensure_future(client.post(
                "/v1/chat/completions", json=chat(f"Question {i}?", system=f"S{i} " * 30)))
                for i in range(6)]
            await asyncio.sleep(0.5)
            name = f"SERVE_REPLICA::tokenmill#{REPLICA_DEPLOYMENT}#{victim}"
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            answers = await asyncio.gather(*batch)
            return [a.status_code for a in answers]

    assert asyncio.run(run()) == [200] * 6
    with httpx.Client(base_url=cluster, timeout=300) as client:
        assert client.post("/v1/chat/completions", json=chat("After.")).status_code == 200


def test_stream_of_a_killed_replica_ends_with_an_error(cluster: str) -> None:
    """A stream already running when its replica dies ends with an error event, no hang."""
    body = chat("Tell me a long story.", system="You tell stories. " * 10, max_tokens=400,
                stream=True, ignore_eos=True)
    with httpx.Client(base_url=cluster, timeout=300) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            name = f"SERVE_REPLICA::tokenmill#{REPLICA_DEPLOYMENT}#{r.headers[REPLICA_HEADER]}"
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            rest = [line for line in lines if line]
        assert "replica_died" in rest[-1] and "data: [DONE]" not in rest
        assert client.post("/v1/chat/completions", json=chat("After.")).status_code == 200


def test_a_replica_whose_engine_died_is_replaced(cluster: str,
                                                 server_config: ServerConfig) -> None:
    """An engine that dies fails its replica's health check: Ray starts another replica, and
    the next requests are answered by it (here a second application under /faulty, whose
    engines fail at their 4th step)."""
    faulty = dataclasses.replace(server_config, debug_fail_at_step=4, models_dir=None)
    serve.run(build_application([(None, engine_config())], faulty,
                                ScaleConfig(replicas=1, health_check_period_s=1.0)),
              name="faulty", route_prefix="/faulty")
    try:
        with httpx.Client(base_url=f"{cluster}/faulty", timeout=300) as client:
            first = client.post("/v1/chat/completions", json=chat("Hi", max_tokens=20))
            assert first.status_code == 500
            dead = first.headers[REPLICA_HEADER]
            for _ in range(120):
                r = client.post("/v1/chat/completions", json=chat("Hi", max_tokens=1))
                if r.status_code == 200:
                    break
                time.sleep(1)
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] != dead
    finally:
        serve.delete("faulty")
