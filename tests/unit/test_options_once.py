"""Engine options are said once, on the config dataclasses' fields: the command line's flags and
``LLM()``'s keywords are derived from them, with the same names, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass

import pytest

from tokenmill import LLM
from tokenmill.cli import build_parser
from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import RunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.args import (
    ENGINE_OPTIONS,
    add_engine_args,
    engine_config,
    engine_config_from_args,
)
from tokenmill.options import add_arguments, build, canonical_keywords, option, options_of
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.model_registry import parse_model_spec

# Fields of the engine's config classes that no user sets: the multi-model server sets them.
INTERNAL_FIELDS = {"CacheConfig.kv_cache_share", "CacheConfig.kv_cache_max_bytes"}

# LLM()'s keywords before they were derived (each must keep working).
LLM_KEYWORDS_BEFORE = (
    "model", "dtype", "max_model_len", "load_format", "seed", "device", "num_threads",
    "kernel_spin_us", "block_size", "num_kv_blocks", "kv_cache_memory_bytes",
    "kv_cache_memory_fraction", "gpu_memory_utilization", "enforce_eager",
    "cuda_graph_max_batch_size", "enable_prefix_caching", "kv_cache_dtype", "max_num_seqs",
    "max_num_batched_tokens", "enable_chunked_prefill", "prefill_first", "async_scheduling",
    "quantization", "speculative", "speculative_model", "num_speculative_tokens", "ngram_min",
    "ngram_max", "tensor_parallel_size", "deterministic", "cost_per_hour", "cpu_watts", "task",
    "pooling", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def engine_parser(several_models: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(p, several_models=several_models)
    return p


def _config_fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """Every leaf field of ``cls`` and of the config classes it holds."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _config_fields(hints[f.name])
        else:
            out.append((cls, f))
    return out


def test_every_field_is_an_option_or_named_internal() -> None:
    fields = _config_fields(EngineConfig)
    plain = {f"{cls.__name__}.{f.name}" for cls, f in fields if "option" not in f.metadata}
    assert plain == INTERNAL_FIELDS
    assert len(ENGINE_OPTIONS) == len(fields) - len(INTERNAL_FIELDS)


def test_each_option_has_one_flag_with_the_fields_default_and_help() -> None:
    actions = [a for a in engine_parser()._actions if a.option_strings and a.dest != "help"]
    by_dest: dict[str, list[argparse.Action]] = {}
    for a in actions:
        if a.help != argparse.SUPPRESS:  # hidden spellings (--no-prefix-caching)
            by_dest.setdefault(a.dest, []).append(a)
    assert set(by_dest) == {o.name for o in ENGINE_OPTIONS}
    for o in ENGINE_OPTIONS:
        [action] = by_dest[o.name]
        assert action.option_strings[0] == "--" + o.name.replace("_", "-")
        assert action.default == o.default
        # BooleanOptionalAction adds " (default: ...)" after the help.
        assert action.help.startswith(o.help), o.name
        assert action.choices == o.choices or (o.type is bool and action.choices is None)
        if o.type is bool:
            assert f"--no-{o.name.replace('_', '-')}" in action.option_strings


def test_each_option_is_an_llm_keyword_with_the_same_default() -> None:
    for o in ENGINE_OPTIONS:
        assert engine_config({o.name: o.default}) == EngineConfig(), o.name
    assert engine_config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_the_keywords_of_before_still_work() -> None:
    values = canonical_keywords(dict.fromkeys(LLM_KEYWORDS_BEFORE), ENGINE_OPTIONS, "LLM()")
    assert len(values) == len(LLM_KEYWORDS_BEFORE)


@pytest.mark.parametrize(("argv", "kwargs"), [
    (["--threads", "3"], {"num_threads": 3}),
    (["--num-threads", "3"], {"threads": 3}),
    (["--num-kv-blocks", "10", "--kv-cache-memory", "4096"],
     {"num_kv_blocks": 10, "kv_cache_memory_bytes": 4096}),
    (["-tp", "2"], {"tensor_parallel_size": 2}),
    (["--no-prefix-caching"], {"enable_prefix_caching": False}),
    (["--speculative-model", "self:2"], {"speculative_model": "self:2"}),
    (["--speculative", "ngram", "--ngram-min", "1"], {"speculative": "ngram", "ngram_min": 1}),
    (["--no-prefill-first", "--async-scheduling"],
     {"prefill_first": False, "async_scheduling": True}),
    (["--enable-lora", "--max-loras", "2"], {"enable_lora": True, "max_loras": 2}),
    (["--dtype", "float32", "--kv-cache-dtype", "float16", "--cpu-watts", "9"],
     {"dtype": "float32", "kv_cache_dtype": "float16", "cpu_watts": 9.0}),
])
def test_a_flag_and_its_keyword_build_the_same_config(argv: list[str],
                                                       kwargs: dict[str, object]) -> None:
    from_flags = engine_config_from_args(engine_parser().parse_args(argv))
    assert from_flags == engine_config(kwargs)
    assert from_flags != EngineConfig()


def test_the_flags_that_were_missing() -> None:
    parse = engine_parser().parse_args
    assert engine_config_from_args(parse([])).scheduler.enable_chunked_prefill
    config = engine_config_from_args(parse(["--no-enable-chunked-prefill",
                                            "--parallel-timeout-s", "30"]))
    assert not config.scheduler.enable_chunked_prefill
    assert config.parallel.timeout_s == 30.0
    assert engine_config({"parallel_timeout_s": 5}).parallel.timeout_s == 5
    with pytest.raises(ValueError, match="timeout_s"):
        engine_config({"parallel_timeout_s": 0})


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, list(range(10, 10 + prompt_len)), params, eos_token_ids=frozenset({2}))


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused() -> None:
    """--no-enable-chunked-prefill: a prompt is computed in one step; one that cannot fit is
    refused instead of waiting forever, and prompt + output stay within one step's budget (a
    preempted request recomputes both at once)."""
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=False), 256)
    with pytest.raises(ValueError, match="max_num_batched_tokens 16"):
        sched.add_request(_request("long", 16, 4))
    sched.add_request(_request("short", 10, 50))
    tokens: list[int] = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        run = RunnerOutput()
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            if req.num_computed_tokens == req.num_tokens:  # caught up: it samples
                run.sampled_token_ids[rid] = [100 + req.num_output_tokens]
        tokens += [t for o in sched.update(out, run) for t in o.new_token_ids]
    assert not sched.has_unfinished()
    assert len(tokens) == 16 - 10


def test_a_draft_model_alone_implies_the_draft_method() -> None:
    assert engine_config({"speculative_model": "self:1"}).speculative.method == "draft"


def test_an_unknown_llm_keyword_is_a_type_error_naming_the_closest() -> None:
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="'threads' and 'num_threads'"):
        LLM(threads=1, num_threads=2)
    with pytest.raises(TypeError, match="log_stats"):  # never read, so no longer an option
        engine_config({"log_stats": True})


def test_a_bad_value_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)


@pytest.mark.parametrize("argv", [
    ["serve", "--threads", "1", "--num-kv-blocks", "64", "--no-prefix-caching",
     "--model", "a=x.gguf", "--model", "y.gguf", "--no-enable-chunked-prefill"],
    ["generate", "hi", "--num-threads", "1", "-tp", "1", "--max-tokens", "5"],
    ["chat", "--kv-cache-memory", "4096", "--temperature", "0"],
    ["info", "--deterministic", "--quantization", "int8"],
    ["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--enable-lora", "--lora-modules", "a=b"],
    ["stream", "--template", "{x}", "--speculative", "ngram"],
    ["bench", "throughput", "--threads", "1"],
    ["bench", "spec", "--threads", "1"],
])
def test_the_commands_parse_their_engine_flags(argv: list[str]) -> None:
    for args in (build_parser().parse_args(argv), build_parser(argv).parse_args(argv)):
        assert {o.name for o in ENGINE_OPTIONS} - {"model"} <= set(vars(args))
        if argv[0] != "serve":
            engine_config_from_args(args)


def test_serve_help_lists_the_derived_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser(["serve"]).parse_args(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--enable-chunked-prefill", "--no-enable-chunked-prefill",
                 "--parallel-timeout-s", "--num-kv-blocks", "--threads", "-tp"):
        assert flag in text


def test_a_served_models_own_options_use_the_same_names() -> None:
    spec = parse_model_spec("chat=m.gguf,kv-cache-memory-bytes=4096,no-enable-chunked-prefill")
    assert spec.own_kv_size
    for server_wide in ("threads=2", "num-threads=2"):
        with pytest.raises(ValueError, match="one per server"):
            parse_model_spec(f"m.gguf,{server_wide}")


@dataclass(frozen=True)
class _Inner:
    size: int = option(2, "a size", aliases=("old_size",))
    internal: int = 0


@dataclass(frozen=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    mode: str = option("a", "a mode", choices=("a", "b"), name="outer_mode")
    on: bool | None = option(None, "maybe")


def test_the_derivation_on_a_small_class() -> None:
    options = options_of(_Outer)
    assert [o.name for o in options] == ["size", "outer_mode", "on"]
    p = argparse.ArgumentParser()
    add_arguments(p, options)
    args = p.parse_args(["--old-size", "5", "--outer-mode", "b", "--no-on"])
    assert build(_Outer, vars(args)) == _Outer(_Inner(size=5), mode="b", on=False)
    assert build(_Outer, {}) == _Outer()
    with pytest.raises(SystemExit):
        p.parse_args(["--outer-mode", "c"])


def test_an_option_of_an_unknown_type_or_a_repeated_name_is_refused() -> None:
    @dataclass(frozen=True)
    class Listy:
        xs: list = option(None, "no lists")

    @dataclass(frozen=True)
    class Twice:
        inner: _Inner = dataclasses.field(default_factory=_Inner)
        size: int = option(1, "again")

    with pytest.raises(TypeError, match="Listy.xs"):
        options_of(Listy)
    with pytest.raises(TypeError, match="size"):
        options_of(Twice)
