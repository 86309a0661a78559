"""The admin API: off without --admin-key, 401 without it; load, unload, a load that fails,
and a blue/green swap under a steady stream of requests that none of them notices."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Server, start_server, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from hf_checkpoints import COMMON, randomize, write_tokenizer  # noqa: E402

KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
PROMPT = "t5 t9 t13 t21"


def tiny_llama(path: Path, seed: int) -> Path:
    """A random 2-layer Llama folder with a word-level tokenizer: fast to load, and two seeds
    answer the same prompt differently."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    randomize(model, seed=seed)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    tiny_llama(root / "v1", seed=1)
    tiny_llama(root / "v2", seed=2)
    tiny_llama(root / "v3", seed=3)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    return root


@pytest.fixture(scope="module")
def admin(models_dir: Path) -> Iterator[Server]:
    s = start_server("--model", f"m={models_dir / 'v1'}", "--max-model-len", "256",
                     "--admin-key", KEY, "--models-dir",
                     str(models_dir), env={"TOKENMILL_FUSED_DECODE": "0"})
    yield s
    assert s.stop() == 0, s.log()


def complete(server: Server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def test_admin_routes_do_not_exist_without_an_admin_key(server: Server) -> None:
    r = httpx.get(f"{server.url}/admin/models", headers=ADMIN)
    assert r.status_code == 404


def test_admin_calls_need_the_admin_key(admin: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{admin.url}/admin/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    r = httpx.get(f"{admin.url}/admin/models", headers=ADMIN)
    [m] = r.json()["data"]
    assert m["name"] == "m" and m["state"] == "serving" and m["weight_bytes"] > 0


def test_load_use_and_unload(admin: Server, models_dir: Path) -> None:
    r = httpx.post(f"{admin.url}/admin/models", headers=ADMIN, timeout=120,
                   json={"name": "m2", "path": "v2", "options": {"max-model-len": 128}})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "m2" and r.json()["path"] == str(models_dir / "v2")
    listed = httpx.get(f"{admin.url}/v1/models").json()["data"]
    assert {m["id"]: m["max_model_len"] for m in listed} == {"m": 256, "m2": 128}
    assert complete(admin, "m2").status_code == 200
    again = httpx.post(f"{admin.url}/admin/models", headers=ADMIN,
                       json={"name": "m2", "path": "v1"})
    assert again.status_code == 409
    r = httpx.delete(f"{admin.url}/admin/models/m2", headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert complete(admin, "m2").status_code == 404
    assert httpx.delete(f"{admin.url}/admin/models/m2", headers=ADMIN).status_code == 404
    assert httpx.delete(f"{admin.url}/admin/models/m", headers=ADMIN).status_code == 409


@pytest.mark.parametrize("body, status, words", [
    ({"name": "x", "path": "/etc"}, 400, "not found in the models folder"),
    ({"name": "x", "path": "../.."}, 400, "not found in the models folder"),
    ({"name": "x", "path": "broken"}, 400, "loading 'x' failed"),
    ({"name": "x", "path": "nowhere"}, 400, "not found in the models folder"),
    ({"name": "x", "path": "v1", "options": {"max-model-len": "lots"}}, 400, "max-model-len"),
    ({"name": "x", "path": "v1", "options": {"threads": 3}}, 400, "one per server"),
    ({"name": "x"}, 400, "path"),
])
def test_bad_loads_change_nothing(admin: Server, body: dict, status: int, words: str) -> None:
    import re
    r = httpx.post(f"{admin.url}/admin/models", headers=ADMIN, json=body, timeout=60)
    assert r.status_code == status and re.search(words, r.json()["error"]["message"]), r.text
    assert [m["id"] for m in httpx.get(f"{admin.url}/v1/models").json()["data"]] == ["m"]
    assert complete(admin, "m").status_code == 200


def test_swap_under_load_loses_nothing(admin: Server) -> None:
    before = complete(admin, "m").json()["choices"][0]["text"]
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            r = complete(admin, "m")
            results.append((r.status_code, r.json()["choices"][0]["text"]
                            if r.status_code == 200 else r.text))

    workers = [threading.Thread(target=stream) for _ in range(3)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    failed = httpx.put(f"{admin.url}/admin/models/m", headers=ADMIN, timeout=60,
                       json={"path": "broken"})
    assert failed.status_code == 400  # the old version keeps serving
    swap = httpx.put(f"{admin.url}/admin/models/m", headers=ADMIN, timeout=120,
                     json={"path": "v2"})
    assert swap.status_code == 200, swap.text
    time.sleep(1.0)
    stop.set()
    for w in workers:
        w.join()
    assert all(code == 200 for code, _ in results), [r for r in results if r[0] != 200]
    after = complete(admin, "m").json()["choices"][0]["text"]
    assert after != before
    texts = [t for _, t in results]
    assert set(texts) == {before, after}  # every answer came from one version or the other
    assert texts[-1] == after and texts.index(after) > 0


@pytest.fixture(scope="module")
def on_demand(models_dir: Path) -> Iterator[Server]:
    s = start_server("--model", f"m={models_dir / 'v1'}", "--max-model-len", "256",
                     "--models-dir", str(models_dir), "--max-loaded-models", "2",
                     "--keep-alive", "3", env={"TOKENMILL_FUSED_DECODE": "0"})
    yield s
    assert s.stop() == 0, s.log()


def loaded(server: Server) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]


def test_models_load_on_demand_and_the_least_recently_used_makes_room(on_demand: Server) -> None:
    """As Ollama: a request for a model in --models-dir loads it (concurrent requests share
    one load); at --max-loaded-models the least recently used idle one is unloaded; the
    command-line model stays; a name that is not there is a 404; idle models go after
    --keep-alive."""
    assert loaded(on_demand) == ["m"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: complete(on_demand, "v2").status_code, range(3)))
    assert codes == [200, 200, 200] and loaded(on_demand) == ["m", "v2"]
    assert on_demand.log().count("loaded 'v2'") == 1
    assert complete(on_demand, "v3").status_code == 200
    assert loaded(on_demand) == ["m", "v3"]  # v2 made room; m is pinned
    assert complete(on_demand, "nowhere").status_code == 404
    assert complete(on_demand, "../v1").status_code == 404
    assert wait_for(lambda: loaded(on_demand) == ["m"], timeout=30)
    assert complete(on_demand, "m").status_code == 200
