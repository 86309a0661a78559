"""Loading on demand (--models-dir) without loading real engines: every spelling of one file
is one model, on-demand models share the server's one KV budget, --max-loaded-models has a
default, and a model too big for the free memory makes room or is refused with a 503."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmill.api.errors import APIError
from tokenmill.cli import build_parser
from tokenmill.config import EngineConfig
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server import lifecycle
from tokenmill.server.lifecycle import ModelManager
from tokenmill.server.model_registry import LoadBudget, ModelFactory, ModelSpec
from tokenmill.server.models_dir import default_max_loaded_models
from tokenmill.server.state import ServedModel, ServerState

MIB = 1 << 20
# What a fake engine's default KV cache takes when nothing caps it (its "workload").
OWN_KV = 500 * MIB


class FakeClient:
    num_seqs_in_flight = 0

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[EngineConfig]]:
    """A models folder of three files, and the configs of the engines "loaded" from it."""
    for name in ("a.gguf", "b.gguf", "c.gguf"):
        (tmp_path / name).write_bytes(b"GGUF" * 256)
    made: list[EngineConfig] = []

    def load(config: EngineConfig) -> EngineConfig:
        made.append(config)
        return config

    def serve(state: ServerState, name: str, config: EngineConfig) -> ServedModel:
        cap = config.cache.kv_cache_max_bytes
        kv = OWN_KV if cap is None else min(cap, OWN_KV)
        return ServedModel(name, FakeClient(), path=config.model.model,  # type: ignore[arg-type]
                           kv_cache_bytes=kv)

    monkeypatch.setattr(lifecycle, "load_engine_for_thread", load)
    monkeypatch.setattr(lifecycle, "serve_engine", serve)
    return tmp_path, made


def manager(folder: Path, budget: LoadBudget, limit: int | None = 4,
            pinned_kv: int = 400 * MIB,
            started: dict[str, EngineConfig] | None = None) -> ModelManager:
    """A manager over one command-line model (not on demand) holding ``pinned_kv``."""
    state = ServerState(SimpleNamespace(monitor=None), {},  # type: ignore[arg-type]
                        PrometheusMetrics())
    state.models["m"] = ServedModel("m", FakeClient(), path="/elsewhere/m.gguf",  # type: ignore[arg-type]
                                    kv_cache_bytes=pinned_kv)
    factory = ModelFactory(build_parser().parse_args(["serve"]), budget)
    return ModelManager(state, factory, str(folder), limit, budget=budget, started=started)


def test_every_spelling_of_a_file_is_one_model(models: tuple[Path, list]) -> None:
    folder, made = models
    m = manager(folder, LoadBudget())

    async def go() -> list[str]:
        names = ["a.gguf", "./a.gguf", str(folder / "a.gguf"), "b.gguf/../a.gguf"]
        served = [await m.load_on_demand(name) for name in names]
        return [s.name for s in served if s is not None]

    assert asyncio.run(go()) == ["a.gguf"] * 4
    assert len(made) == 1 and list(m.state.models) == ["m", "a.gguf"]
    assert made[0].model.model == str(folder / "a.gguf")


def test_concurrent_spellings_share_one_load(models: tuple[Path, list]) -> None:
    folder, made = models
    m = manager(folder, LoadBudget())

    async def go() -> set[str]:
        served = await asyncio.gather(m.load_on_demand("a.gguf"),
                                      m.load_on_demand("./a.gguf"))
        return {s.name for s in served if s is not None}

    assert asyncio.run(go()) == {"a.gguf"} and len(made) == 1


def test_on_demand_models_share_the_kv_budget(models: tuple[Path, list]) -> None:
    """Each on-demand model once took a default KV cache of its own (4 GiB each)."""
    folder, made = models
    m = manager(folder, LoadBudget(kv_bytes=1000 * MIB), limit=4)

    async def load(name: str) -> ServedModel | None:
        return await m.load_on_demand(name)

    a = asyncio.run(load("a.gguf"))
    assert made[-1].cache.kv_cache_max_bytes == 600 * MIB  # the budget less m's 400 MiB
    assert made[-1].cache.kv_cache_memory_bytes is None
    assert a is not None and a.kv_cache_bytes == 500 * MIB
    # 100 MiB are left, less than a fair share (1000 / 4): the idle on-demand model makes room.
    b = asyncio.run(load("b.gguf"))
    assert list(m.state.models) == ["m", "b.gguf"] and b is not None
    assert made[-1].cache.kv_cache_max_bytes == 600 * MIB


def test_no_budget_left_and_nothing_idle_is_a_503(models: tuple[Path, list]) -> None:
    folder, made = models
    m = manager(folder, LoadBudget(kv_bytes=400 * MIB), limit=4)
    with pytest.raises(APIError) as e:
        asyncio.run(m.load_on_demand("a.gguf"))
    assert e.value.status == 503 and "KV cache budget" in e.value.message and not made
    # What is served goes on being served.
    assert list(m.state.models) == ["m"]


def test_a_model_larger_than_free_memory_is_refused(models: tuple[Path, list]) -> None:
    folder, made = models
    m = manager(folder, LoadBudget(free_memory=lambda: 100))
    with pytest.raises(APIError) as e:
        asyncio.run(m.load_on_demand("a.gguf"))
    assert e.value.status == 503 and "memory" in e.value.message and not made
    roomy = manager(folder, LoadBudget(free_memory=lambda: 1 << 40))
    assert asyncio.run(roomy.load_on_demand("a.gguf")) is not None


def test_max_loaded_models_has_a_default(models: tuple[Path, list]) -> None:
    folder, made = models
    m = manager(folder, LoadBudget(), limit=None)
    assert m.max_loaded_models == default_max_loaded_models(1)
    assert 2 <= m.max_loaded_models <= 4

    async def go() -> list[str]:
        for name in ("a.gguf", "b.gguf", "c.gguf"):
            await m.load_on_demand(name)
        return list(m.state.models)

    loaded = asyncio.run(go())
    assert len(loaded) <= m.max_loaded_models and loaded[0] == "m" and loaded[-1] == "c.gguf"


def test_a_model_given_at_start_loads_back_after_an_unload(models: tuple[Path, list]) -> None:
    """The embedded embedding model is no file in --models-dir: once unloaded, it could not
    be loaded back."""
    folder, made = models
    args = build_parser().parse_args(["serve", "--task", "embed"])
    embedded = ModelFactory(args)(ModelSpec(None, None, ("--task", "embed")))
    m = manager(folder, LoadBudget(), started={"e": embedded})
    m.state.models["e"] = ServedModel("e", FakeClient(), task="embed")  # type: ignore[arg-type]

    async def go() -> ServedModel | None:
        await m.unload("e")
        assert "e" not in m.state.models
        return await m.load_on_demand("e")

    served = asyncio.run(go())
    assert served is not None and served.name == "e" and made == [embedded]
    assert list(m.state.models) == ["m", "e"]
    # A name that is neither a file in the folder nor a model given at start is still none.
    assert asyncio.run(m.load_on_demand("nothing")) is None
