"""Per-model options a request may set (admin load/swap, `--model` specs): no abbreviations,
an allow-list, every path-valued option kept inside --models-dir, and refusals that do not
tell what exists outside it. No model is loaded: the engine factory is stubbed."""

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
from tokenmill.server.lifecycle import LoadRequest, ModelManager
from tokenmill.server.model_registry import ModelSpec, engine_configs, parse_model_spec


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """A models folder with smol.gguf in it, and a real file outside it."""
    inside = tmp_path / "models"
    inside.mkdir()
    (inside / "smol.gguf").write_bytes(b"GGUF")
    (inside / "draft.gguf").write_bytes(b"GGUF")
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"GGUF")
    return inside, outside


@pytest.mark.parametrize("key", ["mode", "mod", "m", "mo"])
def test_an_abbreviation_of_model_is_no_option(key: str, folders: tuple[Path, Path]) -> None:
    """`mode=/etc/passwd` once became `--mode`, which argparse took for `--model`."""
    inside, outside = folders
    spec_text = f"x={inside / 'smol.gguf'},{key}={outside}"
    with pytest.raises(ValueError, match=f"unknown option {key!r}"):
        engine_configs(serve_args(), [parse_model_spec(spec_text)])


def test_no_abbreviation_reaches_the_parser(folders: tuple[Path, Path]) -> None:
    """Even a spec built by hand (flags past the allow-list) cannot abbreviate --model."""
    inside, outside = folders
    spec = ModelSpec("x", str(inside / "smol.gguf"), (f"--mode={outside}",))
    with pytest.raises(ValueError, match="--mode"):
        engine_configs(serve_args(), [spec])


def test_a_value_is_never_read_as_an_option(folders: tuple[Path, Path]) -> None:
    inside, outside = folders
    spec = parse_model_spec(f"x={inside / 'smol.gguf'},seed=--model={outside}")
    with pytest.raises(ValueError, match="seed"):
        engine_configs(serve_args(), [spec])


def test_allowed_options_still_work(folders: tuple[Path, Path]) -> None:
    inside, _ = folders
    spec = LoadRequest("x", str(inside / "smol.gguf"),
                       {"max-model-len": 128, "int8": True, "no-prefix-caching": True,
                        "seed": -1, "kv_share": 2}).spec()
    [config] = engine_configs(serve_args(), [spec])
    assert config.model.model == str(inside / "smol.gguf")
    assert config.model.max_model_len == 128 and config.model.quantization == "int8"
    assert not config.cache.enable_prefix_caching and config.model.seed == -1
    assert spec.kv_share == 2.0


def _manager(models_dir: Path) -> tuple[ModelManager, list[EngineConfig]]:
    """A manager whose engine factory records the configs it is given, loading nothing."""
    state = SimpleNamespace(models={}, adapters={}, metrics=PrometheusMetrics(),
                            load_on_demand=None)
    made: list[EngineConfig] = []
    args = serve_args()

    def make_config(spec: ModelSpec) -> EngineConfig:
        config = engine_configs(args, [spec])[0]
        made.append(config)
        return config

    return ModelManager(state, make_config, str(models_dir)), made  # type: ignore[arg-type]


def _load(manager: ModelManager, path: str, options: dict) -> APIError | None:
    async def go() -> None:
        await manager._build(LoadRequest("x", path, options))

    try:
        asyncio.run(go())
    except APIError as e:
        return e
    return None


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(config: EngineConfig) -> None:
        raise RuntimeError("stub: no engine loads in this test")

    monkeypatch.setattr(lifecycle, "load_engine_for_thread", refuse)


def test_speculative_model_stays_inside_the_folder(folders: tuple[Path, Path],
                                                   no_engine: None) -> None:
    inside, outside = folders
    manager, made = _manager(inside)
    error = _load(manager, "smol.gguf", {"speculative-model": str(outside)})
    assert error is not None and error.status == 400
    assert "not found in the models folder" in error.message and not made
    # Inside the folder (relative to it) the draft is taken, as its real path.
    error = _load(manager, "smol.gguf", {"speculative-model": "draft.gguf"})
    assert error is not None and "stub" in error.message  # it reached the engine
    assert made[-1].speculative.draft_model == str(inside / "draft.gguf")
    assert made[-1].model.model == str(inside / "smol.gguf")
    # The target's own first layers are no path.
    _load(manager, "smol.gguf", {"speculative-model": "self:1"})
    assert made[-1].speculative.draft_model == "self:1"


def test_refusals_do_not_tell_what_exists_elsewhere(folders: tuple[Path, Path],
                                                    no_engine: None) -> None:
    inside, outside = folders
    manager, made = _manager(inside)
    missing = outside.with_name("missing.gguf")
    answers = []
    for path, options in ((str(outside), {}), (str(missing), {}),
                          ("../elsewhere.gguf", {}), ("../missing.gguf", {}),
                          ("smol.gguf", {"speculative-model": str(outside)}),
                          ("smol.gguf", {"speculative-model": str(missing)}),
                          ("nowhere.gguf", {})):
        error = _load(manager, path, options)
        assert error is not None and error.status == 400
        named = str(options.get("speculative-model", path))
        answers.append(error.message.replace(named, "<path>"))
    assert not made
    assert len(set(answers[:4])) == 1 and answers[4] == answers[5], answers
    assert "not found in the models folder" in answers[0]
    assert answers[6] == answers[0]  # missing inside reads the same as outside
