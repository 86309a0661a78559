"""`--model NAME=PATH,options` specs, per-model engine configs, the shared KV budget and the
served names (no model is loaded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.cli import build_parser
from tokenmill.server.launcher import served_names
from tokenmill.server.model_registry import (
    ModelSpec,
    engine_configs,
    parse_model_spec,
    share_kv_budget,
)


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_spec_forms(tmp_path) -> None:
    assert parse_model_spec("m.gguf") == ModelSpec(None, "m.gguf")
    assert parse_model_spec("chat=m.gguf") == ModelSpec("chat", "m.gguf")
    spec = parse_model_spec("org/name=dir/x,max-model-len=2048,int8,no-prefix-caching,"
                            "kv_share=2.5")
    assert spec.name == "org/name" and spec.path == "dir/x" and spec.kv_share == 2.5
    assert spec.flags == ("--max-model-len=2048", "--quantization=int8",
                          "--no-prefix-caching")
    assert not spec.own_kv_size and parse_model_spec("a=b,num-kv-blocks=9").own_kv_size
    # A path that exists is a path, even with '=' in it.
    odd = tmp_path / "a=b.gguf"
    odd.write_bytes(b"")
    assert parse_model_spec(str(odd)) == ModelSpec(None, str(odd))


@pytest.mark.parametrize("value, words", [
    ("=m.gguf", "name"), ("chat=", "path"), ("a=m,kv-share=0", "kv-share"),
    ("a=m,kv-share=x", "kv-share"), ("a=m,threads=4", "one per server"),
    ("a=m,model=x", "one per server"),
])
def test_bad_specs_are_named(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_model_spec(value)


def test_engine_configs_take_global_then_own_options(tmp_path) -> None:
    x, y = tmp_path / "x.gguf", tmp_path / "y.gguf"
    x.write_bytes(b"")
    y.write_bytes(b"")
    args = serve_args("--model", f"a={x}", "--model", f"b={y},max-model-len=1024,int8",
                      "--max-model-len", "4096", "--max-num-seqs", "8")
    specs = [parse_model_spec(v) for v in args.model]
    a, b = engine_configs(args, specs)
    assert (a.model.model, a.model.max_model_len, a.scheduler.max_num_seqs) == (str(x), 4096, 8)
    assert (b.model.model, b.model.max_model_len, b.scheduler.max_num_seqs) == (str(y), 1024, 8)
    assert b.model.quantization == "int8" and a.model.quantization != "int8"
    with pytest.raises(ValueError, match="no-such-option"):
        engine_configs(args, [parse_model_spec(f"c={x},no-such-option=1")])
    with pytest.raises(ValueError, match="max-model-len"):
        engine_configs(args, [parse_model_spec(f"c={x},max-model-len=many")])


def test_the_kv_budget_is_split_once(tmp_path) -> None:
    x = tmp_path / "x.gguf"
    x.write_bytes(b"")
    args = serve_args("--model", f"a={x}", "--model", f"b={x},kv-share=3", "--model",
                      f"c={x},kv-cache-memory=1000")
    specs = [parse_model_spec(v) for v in args.model]
    configs = engine_configs(args, specs)
    # CPU, no --kv-cache-memory: the fraction of free memory, capped, split 1:3, as the most
    # each model's default size may take.
    cpu = share_kv_budget(configs, specs, None, free_memory=8 << 30, on_cuda=False)
    budget = int((8 << 30) * configs[0].cache.kv_cache_memory_fraction)
    assert cpu[0].cache.kv_cache_max_bytes == budget // 4
    assert cpu[1].cache.kv_cache_max_bytes == budget * 3 // 4
    assert cpu[0].cache.kv_cache_memory_bytes is None
    assert cpu[2].cache.kv_cache_memory_bytes == 1000  # its own size, outside the split
    # An explicit total is split the same way, on any device.
    given = share_kv_budget(configs, specs, 4000, free_memory=0, on_cuda=True)
    assert [c.cache.kv_cache_memory_bytes for c in given] == [1000, 3000, 1000]
    # CUDA without a total: each takes its share of what the models after it leave.
    cuda = share_kv_budget(configs, specs, None, free_memory=0, on_cuda=True)
    assert [c.cache.kv_cache_share for c in cuda] == [0.25, 1.0, 1.0]
    assert cuda[0].cache.kv_cache_memory_bytes is None
    # One model: untouched.
    assert share_kv_budget(configs[:1], specs[:1], None, 8 << 30, False) == configs[:1]


def test_served_names() -> None:
    engine = SimpleNamespace(model_path="/models/SmolLM2.Q4_1.gguf")
    assert served_names([(None, engine)], None) == ["SmolLM2.Q4_1"]  # type: ignore[list-item]
    assert served_names([(None, engine)], "mine") == ["mine"]  # type: ignore[list-item]
    assert served_names([("a", engine), (None, engine)], None) == [  # type: ignore[list-item]
        "a", "SmolLM2.Q4_1"]
    with pytest.raises(ValueError, match="twice|two models"):
        served_names([(None, engine), (None, engine)], None)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="served-model-name"):
        served_names([("a", engine), ("b", engine)], "x")  # type: ignore[list-item]
