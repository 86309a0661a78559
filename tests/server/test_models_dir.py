"""--models-dir in a real server: admin options cannot reach outside the folder; one file
named three ways is one model; unloaded models leave /metrics; an embedding model unloaded
loads back. After each, the next ordinary request is answered as before."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Server, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "embed"))

from embed_helpers import save_random_bert  # noqa: E402
from test_admin import ADMIN, KEY, complete, loaded, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The models folder (v1, v2, bert) and a real model outside it."""
    from tokenmill.model_loader import embedded_embedding_model_path

    root = tmp_path_factory.mktemp("folder")
    inside = root / "models"
    inside.mkdir()
    tiny_llama(inside / "v1", seed=1)
    tiny_llama(inside / "v2", seed=2)
    save_random_bert(inside / "bert", embedded_embedding_model_path(), seed=4)
    tiny_llama(root / "outside", seed=5)
    return inside, root / "outside"


@pytest.fixture(scope="module")
def server(folders: tuple[Path, Path]) -> Iterator[Server]:
    inside, _ = folders
    s = start_server("--model", f"m={inside / 'v1'}", "--max-model-len", "128",
                     "--admin-key", KEY, "--models-dir", str(inside),
                     "--max-loaded-models", "4", env={"TOKENMILL_FUSED_DECODE": "0"})
    yield s
    assert s.stop() == 0, s.log()


def admin_load(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models", headers=ADMIN, json=body, timeout=120)


@pytest.mark.parametrize("options", [
    {"mode": "OUTSIDE"}, {"mod": "OUTSIDE"}, {"speculative-model": "OUTSIDE"},
    {"speculative-model": "OUTSIDE", "num-speculative-tokens": 2},
])
def test_options_cannot_load_from_outside_the_folder(server: Server, folders: tuple[Path, Path],
                                                     options: dict) -> None:
    """`mode` once became --model (argparse's abbreviations) and loaded the model outside the
    folder with a 201; `speculative-model` was never checked."""
    _, outside = folders
    options = {k: str(outside) if v == "OUTSIDE" else v for k, v in options.items()}
    r = admin_load(server, {"name": "x", "path": "v1", "options": options})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "unknown option" in message or "not found in the models folder" in message
    assert loaded(server) == ["m"]
    assert complete(server, "m").status_code == 200


def test_refusals_say_nothing_of_the_disk_outside(server: Server,
                                                  folders: tuple[Path, Path]) -> None:
    _, outside = folders
    answers = []
    for path in (str(outside), str(outside.with_name("missing")), "nowhere"):
        for body in ({"name": "x", "path": path},
                     {"name": "x", "path": "v1", "options": {"speculative-model": path}}):
            r = admin_load(server, body)
            assert r.status_code == 400, r.text
            answers.append(r.json()["error"]["message"].replace(path, "<path>"))
    assert len(set(answers[0::2])) == 1 and len(set(answers[1::2])) == 1, answers
    assert "not found in the models folder" in answers[0]
    assert complete(server, "m").status_code == 200


def test_one_file_named_three_ways_is_one_model(server: Server,
                                                folders: tuple[Path, Path]) -> None:
    inside, _ = folders
    names = ["v2", "./v2", str(inside / "v2"), "v1/../v2"]
    answers = [complete(server, name) for name in names]
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert {r.json()["model"] for r in answers} == {"v2"}
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    assert loaded(server) == ["m", "v2"]
    assert server.log().count("loaded 'v2'") == 1
    # The command-line model's file under another name is that model too.
    r = complete(server, "v1")
    assert r.status_code == 200 and r.json()["model"] == "m"
    assert loaded(server) == ["m", "v2"]
    httpx.delete(f"{server.url}/admin/models/v2", headers=ADMIN, timeout=60)
    assert complete(server, "m").status_code == 200


def _model_names(server: Server) -> set[str]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {line.split('model_name="', 1)[1].split('"', 1)[0]
            for line in text.splitlines() if 'model_name="' in line}


def test_unloaded_and_swapped_out_models_leave_metrics(server: Server) -> None:
    r = admin_load(server, {"name": "m2", "path": "v2"})
    assert r.status_code == 201, r.text
    assert complete(server, "m2").status_code == 200
    assert "m2" in _model_names(server)
    r = httpx.delete(f"{server.url}/admin/models/m2", headers=ADMIN, timeout=60)
    assert r.status_code == 200
    assert "m2" not in _model_names(server)
    # A swap leaves one cache_config_info sample for the name, the new version's.
    swap = httpx.put(f"{server.url}/admin/models/m", headers=ADMIN, timeout=120,
                     json={"path": "v1", "options": {"block-size": 32}})
    assert swap.status_code == 200, swap.text
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    infos = [line for line in text.splitlines()
             if line.startswith("tokenmill:cache_config_info{") and 'model_name="m"' in line]
    assert len(infos) == 1 and 'block_size="32"' in infos[0], infos
    assert complete(server, "m").status_code == 200


def embed(server: Server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                      json={"model": model, "input": "a short sentence"})


def test_an_unloaded_embedding_model_loads_back(server: Server) -> None:
    first = embed(server, "bert")
    assert first.status_code == 200, first.text
    r = httpx.delete(f"{server.url}/admin/models/bert", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    again = embed(server, "bert")
    assert again.status_code == 200, again.text
    assert again.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
    assert complete(server, "m").status_code == 200


@pytest.fixture(scope="module")
def defaults(folders: tuple[Path, Path]) -> Iterator[Server]:
    """The two embedded models (chat and embeddings), with a models folder beside them."""
    inside, _ = folders
    s = start_server("--admin-key", KEY, "--models-dir", str(inside))
    yield s
    assert s.stop() == 0, s.log()


def test_the_embedded_embedding_model_loads_back(defaults: Server) -> None:
    """It is no file in --models-dir: once unloaded, nothing could load it again."""
    name = "all-MiniLM-L6-v2"
    first = embed(defaults, name)
    assert first.status_code == 200, first.text
    r = httpx.delete(f"{defaults.url}/admin/models/{name}", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    again = embed(defaults, name)
    assert again.status_code == 200, again.text
    assert again.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
    chat = httpx.post(f"{defaults.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
