"""The platform around the engine under `tokenmill serve --replicas 2`, on a local Ray (kept on
127.0.0.1): a tiny random Llama with LoRA on and the embedded embedding model, an admin key,
an API key and runtime adapter loading, and KV events on configured ports.

- The ingress answers the admin API over the one tenancy store; a project key is checked and
  its project's limits applied before routing, and the replicas meter its requests into the
  same store.
- A LoRA adapter loaded while serving is served by every replica (a replica that Ray starts
  later too), and gone from every replica once unloaded.
- Each replica publishes its KV events on the configured port + its rank, with vLLM's replay
  socket on the replay port + its rank.
- Files and vector stores are the ingress's one store (embedded by the embedding model's
  replicas), searched by a replica's file_search; batches are refused by name.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
zmq = pytest.importorskip("zmq")

# A local Ray cluster and engines: minutes on a small machine (in the default run all the same).
pytestmark = pytest.mark.slow

from tokenmill.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ServerConfig,
)
from tokenmill.core.kv_events import BlockStored, decode_batch  # noqa: E402
from tokenmill.serve_ray.app import REPLICA_DEPLOYMENT, ScaleConfig, build_application  # noqa: E402
from tokenmill.serve_ray.messages import REPLICA_HEADER  # noqa: E402
from tokenmill.tenancy.store import TenancyStore  # noqa: E402

ADMIN = {"Authorization": "Bearer adm"}
SERVER = {"Authorization": "Bearer srv"}
DEPLOYMENT = f"{REPLICA_DEPLOYMENT}-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(100):
        first = _free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError(f"no {n} consecutive free ports")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Llama, an adapter of it, the server's options and the KV-event ports."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lora"))
    from lora_helpers import make_adapter, make_base

    root = tmp_path_factory.mktemp("ray_platform")
    base = make_base(root / "base")
    # A chat template, for the Responses API's requests.
    config = json.loads((base.path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (base.path / "tokenizer_config.json").write_text(json.dumps(config))
    events = _free_run(4)  # two replicas' events, then their replay sockets
    model = EngineConfig(
        model=ModelConfig(model=str(base.path), max_model_len=256),
        cache=CacheConfig(num_blocks=32, block_size=16,
                          kv_events_endpoint=f"tcp://127.0.0.1:{events}",
                          kv_events_replay_endpoint=f"tcp://127.0.0.1:{events + 2}"),
        lora=LoRAConfig(enable_lora=True), device=DeviceConfig(num_threads=1))
    server = ServerConfig(host="127.0.0.1", port=_free_port(), admin_key="adm", api_key="srv",
                          data_dir=str(root / "data"), allow_runtime_lora_updating=True)
    embed = EngineConfig(model=ModelConfig(task="embed", max_model_len=256),
                         device=DeviceConfig(num_threads=1))
    return {"model": model, "embed": embed, "server": server, "events": events,
            "adapter": str(make_adapter(base, root / "sql", seed=3))}


@pytest.fixture(scope="module")
def cluster(setup: dict) -> Iterator[str]:
    """Two replicas of "tiny" on a local Ray; the ingress's base URL."""
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                            "OMP_NUM_THREADS")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["OMP_NUM_THREADS"] = "1"
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        server = setup["server"]
        serve.start(http_options={"host": "127.0.0.1", "port": server.port})
        app = build_application([("tiny", setup["model"]), (None, setup["embed"])], server,
                                ScaleConfig(replicas=2, replica_cpus=1.0))
        serve.run(app, name="tokenmill", route_prefix="/")
        yield f"http://127.0.0.1:{server.port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _complete(client: httpx.Client, prompt: str, model: str = "tiny",
              headers: dict | None = None) -> httpx.Response:
    return client.post("/v1/completions", headers=headers or SERVER, json={
        "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0.0})


def _prompt(i: int, words: int = 6) -> str:
    return " ".join(f"t{(i * 7 + j) % 200}" for j in range(words))


def test_projects_are_checked_at_the_ingress_and_metered_by_the_replicas(
        cluster: str, setup: dict) -> None:
    with httpx.Client(base_url=cluster, timeout=300) as client:
        project = client.post("/v1/organization/projects", headers=ADMIN, json={
            "name": "team", "max_requests_per_1_minute": 3}).json()
        key = client.post(f"/v1/organization/projects/{project['id']}/api_keys",
                          headers=ADMIN, json={"name": "k"}).json()["value"]
        mine = {"Authorization": f"Bearer {key}"}
        for i in range(3):
            r = _complete(client, _prompt(i), headers=mine)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
        over = _complete(client, _prompt(9), headers=mine)
        assert over.status_code == 429 and "Retry-After" in over.headers
        assert _complete(client, _prompt(1), headers={
            "Authorization": "Bearer sk-proj-unknown"}).status_code == 401
        assert client.get("/v1/organization/projects").status_code == 401
        listed = client.get("/v1/organization/projects", headers=ADMIN).json()["data"]
        assert [p["id"] for p in listed] == [project["id"]]
        refused = client.post("/admin/models", headers=ADMIN, json={"name": "x", "path": "y"})
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "unsupported_with_replicas"
        # The next request with the server's key is answered as before.
        assert _complete(client, _prompt(5)).status_code == 200
    # The replicas wrote each admitted request's usage into the ingress's store.
    rows = TenancyStore(setup["server"].data_dir).usage_rows(0)
    ours = [r for r in rows if r["project_id"] == project["id"]]
    assert len(ours) == 3 and all(r["input_tokens"] > 0 and r["output_tokens"] == 3
                                  for r in ours)


def _answers_on_both(client: httpx.Client, model: str, start: int) -> set[str]:
    """Requests for ``model`` until both replicas answered one; the replicas seen."""
    seen: set[str] = set()
    for i in range(start, start + 30):
        r = _complete(client, _prompt(i, words=20 + i % 7), model=model)
        if r.status_code == 503:  # no replica up for a moment (one was just killed)
            continue
        assert r.status_code == 200, r.text
        seen.add(r.headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    return seen


def test_a_runtime_adapter_reaches_every_replica(cluster: str, setup: dict) -> None:
    load = {"lora_name": "sql", "lora_path": setup["adapter"], "base_model_name": "tiny"}
    with httpx.Client(base_url=cluster, timeout=300) as client:
        # As on one server with an admin key: only it may load adapters.
        assert client.post("/v1/load_lora_adapter", headers=SERVER,
                           json=load).status_code == 401
        r = client.post("/v1/load_lora_adapter", headers=ADMIN, json=load)
        assert r.status_code == 200 and "'sql' loaded" in r.text
        again = client.post("/v1/load_lora_adapter", headers=ADMIN, json=load)
        assert again.status_code == 400  # the replica's own answer: the name is taken
        assert "sql" in [m["id"] for m in client.get("/v1/models", headers=SERVER).json()["data"]]
        assert len(_answers_on_both(client, "sql", 0)) == 2
        # A replica Ray starts later (a replacement) catches up before it answers.
        victim = _complete(client, _prompt(1), model="sql").headers[REPLICA_HEADER]
        name = f"SERVE_REPLICA::tokenmill#{DEPLOYMENT}#{victim}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        deadline, start = time.monotonic() + 600, 100
        seen: set[str] = set()
        while time.monotonic() < deadline and len(seen - {victim}) < 2:
            # Fresh prompts: no replica holds their prefix, so the emptier one gets them.
            seen |= _answers_on_both(client, "sql", start)
            start += 30
            time.sleep(1)
        assert len(seen - {victim}) == 2, seen
        r = client.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "sql"})
        assert r.status_code == 200
        for i in range(4):
            assert _complete(client, _prompt(i), model="sql").status_code == 404
        assert _complete(client, _prompt(2)).status_code == 200


def _subscribe(port: int) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def test_each_replica_publishes_on_its_port_with_a_replay_socket(cluster: str,
                                                                 setup: dict) -> None:
    events = setup["events"]
    subs = {rank: _subscribe(events + rank) for rank in (0, 1)}
    heard: dict[int, list] = {0: [], 1: []}
    try:
        with httpx.Client(base_url=cluster, timeout=300) as client:
            for i in range(40):
                r = _complete(client, " ".join(f"t{(i * 13 + j) % 250}" for j in range(40)))
                assert r.status_code == 200
                for rank, sub in subs.items():
                    try:
                        while True:
                            heard[rank].append(decode_batch(sub.recv_multipart()[-1]))
                    except zmq.Again:
                        pass
                if heard[0] and heard[1]:
                    break
        assert heard[0] and heard[1], "each replica publishes on its own port"
        stored = [e for b in heard[0] + heard[1] for e in b.events if isinstance(e, BlockStored)]
        assert stored and all(e.block_size == 16 and e.lora_id is None for e in stored)
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 10_000)
        replay.connect(f"tcp://127.0.0.1:{events + 2}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            frames.append(decode_batch(payload))
        replay.close(linger=0)
        assert frames, "the replay socket resends the replica's batches"
    finally:
        for sub in subs.values():
            sub.close(linger=0)


def _wait_done(client: openai.OpenAI, store_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while client.vector_stores.retrieve(store_id).file_counts.in_progress:
        assert time.monotonic() < deadline, "ingestion did not finish"
        time.sleep(0.2)


def test_files_and_vector_stores_are_the_ingresss(cluster: str) -> None:
    """One store at the ingress, embedded by the embedding model's replicas: files, vector
    stores and search as one server answers them, the Responses API's file_search on a
    replica searching it, a project's objects its own; batches are refused by name."""
    api = openai.OpenAI(base_url=f"{cluster}/v1", api_key="srv", max_retries=0, timeout=300)
    note = api.files.create(file=("lighthouse.txt", b"t40 t41 t42 The lighthouse code word "
                                  b"is PELICAN. t43 t44", "text/plain"), purpose="assistants")
    other = api.files.create(file=("bakery.txt", b"The bakery opens at seven with fresh bread.",
                                   "text/plain"), purpose="assistants")
    store = api.vector_stores.create(name="docs", file_ids=[note.id, other.id])
    _wait_done(api, store.id)
    assert api.vector_stores.retrieve(store.id).file_counts.completed == 2
    hits = api.vector_stores.search(store.id, query="lighthouse code word").data
    assert hits[0].file_id == note.id
    answer = api.responses.create(model="tiny", input="t5 t6 lighthouse", max_output_tokens=3,
                                  temperature=0, include=["file_search_call.results"],
                                  tools=[{"type": "file_search", "vector_store_ids": [store.id]}])
    search = answer.output[0]
    assert search.type == "file_search_call" and search.status == "completed"
    assert {r.file_id for r in search.results} == {note.id, other.id}
    with pytest.raises(openai.NotFoundError):  # an unknown store: the search's 404
        api.responses.create(model="tiny", input="t5", max_output_tokens=2, tools=[
            {"type": "file_search", "vector_store_ids": ["vs_nope"]}])
    with httpx.Client(base_url=cluster, timeout=300) as client:
        project = client.post("/v1/organization/projects", headers=ADMIN,
                              json={"name": "files"}).json()
        key = client.post(f"/v1/organization/projects/{project['id']}/api_keys",
                          headers=ADMIN, json={"name": "k"}).json()["value"]
        mine = {"Authorization": f"Bearer {key}"}
        # The server key's objects belong to no project: a project key sees none of them.
        assert client.get(f"/v1/files/{note.id}", headers=mine).status_code == 404
        made = client.post("/v1/files", headers=mine, data={"purpose": "assistants"},
                           files={"file": ("p.txt", b"project words", "text/plain")})
        assert made.status_code == 200
        listed = client.get("/v1/files", headers=mine).json()["data"]
        assert [f["id"] for f in listed] == [made.json()["id"]]
        batch = client.get("/v1/batches", headers=SERVER)
        assert batch.status_code == 400
        assert batch.json()["error"]["code"] == "unsupported_with_replicas"
        assert "--replicas" in batch.json()["error"]["message"]
        assert _complete(client, _prompt(3)).status_code == 200
