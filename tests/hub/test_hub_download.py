"""Models by name through huggingface_hub against the stand-in hub: which files come down,
revisions, resumed downloads, the cache without network, and every refusal saying what to do."""

from __future__ import annotations

import filecmp
import os
import socket
from pathlib import Path

import pytest
from hub_repos import FOLDER_REPO, GATED_REPO, GATED_TOKEN, GGUF_REPO, Q4_1
from stand_in_hub import StandInHub

from tokenmill.hub.download import Hub, resolve_model


@pytest.fixture
def hub(stand_in_hub: tuple[str, StandInHub], tmp_path: Path) -> Hub:
    stand_in_hub[1].requests.clear()
    return Hub(endpoint=stand_in_hub[0], cache_dir=str(tmp_path / "cache"))


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), folder)
                  for d, _, names in os.walk(folder) for n in names)


def test_gguf_repo_picks_the_preferred_quant(hub: Hub, smollm_path: str) -> None:
    path = resolve_model(GGUF_REPO, hub=hub)
    assert path.endswith(Q4_1) and filecmp.cmp(path, smollm_path, shallow=False)
    # Only that file came down, and the second call finds it in the cache.
    assert _files(os.path.dirname(path)) == [Q4_1]
    assert resolve_model(GGUF_REPO, hub=hub) == path


def test_quant_file_and_split_file(hub: Hub) -> None:
    q8 = resolve_model(f"{GGUF_REPO}:q8_0", hub=hub)
    assert Path(q8).read_bytes() == b"q8-main" * 1000
    assert resolve_model(f"{GGUF_REPO}/SmolLM2-135M-Instruct.Q8_0.gguf", hub=hub) == q8
    first = resolve_model(f"{GGUF_REPO}:Q2_K", hub=hub)
    assert first.endswith("SmolLM2-Q2_K-00001-of-00002.gguf")
    assert Path(first.replace("00001-of", "00002-of")).read_bytes() == b"shard-2"


def test_revision_pinning(hub: Hub) -> None:
    old = resolve_model(f"{GGUF_REPO}:Q8_0@v1", hub=hub)
    assert Path(old).read_bytes() == b"q8-v1"
    assert Path(resolve_model(f"{GGUF_REPO}:Q8_0", revision="v1", hub=hub)).read_bytes() == \
        b"q8-v1"
    with pytest.raises(ValueError, match="has no revision 'v9'"):
        resolve_model(f"{GGUF_REPO}@v9", hub=hub)


def test_folder_repo_takes_the_loaders_files_only(hub: Hub) -> None:
    folder = resolve_model(FOLDER_REPO, hub=hub)
    assert _files(folder) == ["1_Pooling/config.json", "chat_template.jinja", "config.json",
                              "model.safetensors", "tokenizer.json"]


def test_a_local_path_wins(tmp_path: Path, hub: Hub) -> None:
    local = tmp_path / GGUF_REPO
    local.mkdir(parents=True)
    assert resolve_model(str(local), hub=hub) == str(local)
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_model(GGUF_REPO, hub=hub) == GGUF_REPO
    finally:
        os.chdir(old)
    with pytest.raises(ValueError, match="--revision 'v1' is for a model named on the hub"):
        resolve_model(str(local), revision="v1", hub=hub)


def test_refusals_name_the_way_out(hub: Hub) -> None:
    with pytest.raises(ValueError, match="no repo tokenmill-test/nope on http"):
        resolve_model("tokenmill-test/nope", hub=hub)
    with pytest.raises(ValueError, match=r"no Q5_K_M GGUF file; it has: Q2_K, Q4_1, Q8_0"):
        resolve_model(f"{GGUF_REPO}:Q5_K_M", hub=hub)
    with pytest.raises(ValueError, match="neither a GGUF file .* nor a Hugging Face repo"):
        resolve_model("no-such-file.gguf", hub=hub)


def test_gated_repo_needs_a_token(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ValueError, match="gated repo: accept its conditions at .* HF_TOKEN"):
        resolve_model(GATED_REPO, hub=hub)
    with_token = Hub(hub.endpoint, hub.cache_dir, token=GATED_TOKEN)
    assert Path(resolve_model(GATED_REPO, hub=with_token)).read_bytes() == b"gated"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_without_network_the_cache_serves_and_a_miss_says_how_to_work_offline(
        hub: Hub, stand_in_hub: tuple[str, StandInHub], monkeypatch: pytest.MonkeyPatch) -> None:
    q8 = resolve_model(f"{GGUF_REPO}:Q8_0", hub=hub)
    offline = Hub(endpoint=_closed_port_url(), cache_dir=hub.cache_dir)
    assert resolve_model(f"{GGUF_REPO}:Q8_0", hub=offline) == q8
    with pytest.raises(ValueError, match=r"cannot reach http://127.0.0.1:\d+ .* not in the "
                                         r"local cache .* `tokenmill pull "):
        resolve_model(f"{GGUF_REPO}:Q2_K", hub=offline)
    with pytest.raises(ValueError, match="cannot reach"):
        resolve_model("tokenmill-test/never-pulled", hub=offline)
    from huggingface_hub import constants

    monkeypatch.setattr(stand_in_hub[1], "fail_with", 503)  # the hub is down: the same
    assert resolve_model(f"{GGUF_REPO}:Q8_0", hub=hub) == q8
    with pytest.raises(ValueError, match="cannot reach .* not in the local cache"):
        resolve_model(f"{GGUF_REPO}:Q2_K", hub=hub)
    monkeypatch.setattr(stand_in_hub[1], "fail_with", None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model(f"{GGUF_REPO}:Q8_0", hub=hub) == q8
    with pytest.raises(ValueError, match="not in the local cache .* HF_HUB_OFFLINE is set"):
        resolve_model(FOLDER_REPO, hub=hub)


def test_a_dropped_download_resumes_where_it_stopped(
        hub: Hub, stand_in_hub: tuple[str, StandInHub], smollm_path: str) -> None:
    half = os.path.getsize(smollm_path) // 2
    stand_in_hub[1].drop_once[Q4_1] = half
    path = resolve_model(GGUF_REPO, hub=hub)
    assert filecmp.cmp(path, smollm_path, shallow=False)
    gets = [r for r in stand_in_hub[1].requests if r[0] == "GET" and r[1].endswith(Q4_1)]
    # The second GET asks for the rest: from what had arrived (whole chunks of it).
    assert len(gets) == 2 and gets[0][2] is None
    start = int(gets[1][2].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= half
