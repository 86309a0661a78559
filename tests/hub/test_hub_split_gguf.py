"""A split GGUF fetched by name (ORG/NAME:QUANT) comes down whole and loads as one model from
the first shard the hub resolves to."""

from __future__ import annotations

from pathlib import Path

from gguf_split_files import write_split_copy
from stand_in_hub import Repo, commit_id, serve_hub

from tokenmill.hub.download import Hub, resolve_model
from tokenmill.model_loader.gguf import load_gguf

SPLIT_REPO = "tokenmill-test/split-GGUF"


def test_split_repo_resolves_to_a_loadable_first_shard(smollm_path: str, tmp_path: Path) -> None:
    shards = write_split_copy(smollm_path, tmp_path, 3, stem="SmolLM2-Q4_1")
    files: dict[str, str | bytes] = {s.name: str(s) for s in shards}
    files["SmolLM2-Q8_0.gguf"] = b"another quantization, not fetched"
    repo = Repo(commits={commit_id("split"): files}, refs={"main": commit_id("split")})
    with serve_hub({SPLIT_REPO: repo}) as (endpoint, _):
        hub = Hub(endpoint=endpoint, cache_dir=str(tmp_path / "cache"))
        path = resolve_model(f"{SPLIT_REPO}:Q4_1", hub=hub)
    assert Path(path).name == shards[0].name
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [s.name for s in shards]
    model, single = load_gguf(path), load_gguf(smollm_path)
    assert model.tensor_names() == single.tensor_names()
    assert model.hf_config == single.hf_config
