"""Pure-Python parts of embeddings: the scheduler's handling of pooling requests (with
made-up runner outputs), sentence-transformers configs, and the embedded model's extraction."""

from __future__ import annotations

import json
import multiprocessing
import zipfile
from pathlib import Path

import pytest
import torch

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager, NoKVCache
from tokenmill.core.sched_output import RunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.pooling import EMBEDDING_SAMPLING
from tokenmill.model_loader.embedded_embedding import extract_once
from tokenmill.model_loader.st_config import read_sentence_transformer
from tokenmill.models.pooler import finish_embedding, pool
from tokenmill.request import Request
from tokenmill.sampling_params import PoolingParams


def _pooling_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), EMBEDDING_SAMPLING, pooling_params=PoolingParams())


def _scheduler(kv: KVCacheManager, budget: int = 64, max_model_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv,
                     max_model_len)


@pytest.mark.parametrize("kv", [NoKVCache(16), KVCacheManager(32, 16)],
                         ids=["encoder", "decoder"])
def test_pooling_requests_run_whole_and_finish_with_their_vector(kv: KVCacheManager) -> None:
    sched = _scheduler(kv, budget=40)
    for rid, n in (("a", 30), ("b", 8), ("c", 20)):
        sched.add_request(_pooling_request(rid, n))
    out = sched.schedule()
    # a and b fit in 40 tokens; c is never chunked, so it waits for the next step.
    assert out.num_scheduled_tokens == {"a": 30, "b": 8}
    assert all(r.pooling_params is not None for r in out.new_requests)
    results = sched.update(out, RunnerOutput(pooled={"a": [1.0], "b": [2.0]}))
    assert [(o.request_id, o.pooled, o.finish_reason) for o in results] == [
        ("a", [1.0], "stop"), ("b", [2.0], "stop")]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"c": 20}
    assert out.finished_request_ids == {"a", "b"}
    sched.update(out, RunnerOutput(pooled={"c": [3.0]}))
    assert not sched.has_unfinished()
    assert kv.usage == 0.0


def test_a_pooling_request_may_fill_the_context_but_not_exceed_a_step() -> None:
    sched = _scheduler(NoKVCache(16), budget=32, max_model_len=64)
    sched.add_request(_pooling_request("full", 32))  # no room for a token needed
    with pytest.raises(ValueError, match="max_num_batched_tokens 32"):
        sched.add_request(_pooling_request("big", 40))
    with pytest.raises(ValueError, match="more than max_model_len 64"):
        _scheduler(NoKVCache(16), budget=128).add_request(_pooling_request("x", 65))


def test_no_kv_cache_holds_nothing() -> None:
    kv = NoKVCache(16)
    assert kv.allocate_new("r", [], 10_000) == []
    assert kv.can_ever_fit(10**9) and kv.usage == 0.0 and kv.get_block_ids("r") == []


def test_pool_methods_and_dimensions() -> None:
    hidden = torch.tensor([[1.0, 0.0], [3.0, 4.0], [5.0, 2.0], [0.0, 1.0]])
    spans = [(0, 3), (3, 1)]
    torch.testing.assert_close(pool(hidden, spans, "cls"), hidden[[0, 3]])
    torch.testing.assert_close(pool(hidden, spans, "last"), hidden[[2, 3]])
    torch.testing.assert_close(pool(hidden, spans, "mean"),
                               torch.tensor([[3.0, 2.0], [0.0, 1.0]]))
    torch.testing.assert_close(pool(hidden, spans, "max"), torch.tensor([[5.0, 4.0], [0.0, 1.0]]))
    torch.testing.assert_close(finish_embedding(torch.tensor([3.0, 4.0, 12.0]), 2, True),
                               torch.tensor([0.6, 0.8]))


def _st_folder(tmp_path: Path, pooling: dict, modules: list[str]) -> Path:
    entries = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{t}"}
               for i, (t, path) in enumerate((m, {"Pooling": "1_Pooling"}.get(m, ""))
                                             for m in modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return tmp_path


@pytest.mark.parametrize(("flag", "method"), [
    ("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"), ("pooling_mode_lasttoken", "last")])
def test_sentence_transformers_pooling(tmp_path: Path, flag: str, method: str) -> None:
    info = read_sentence_transformer(str(_st_folder(tmp_path, {flag: True},
                                                    ["Transformer", "Pooling", "Normalize"])))
    assert info is not None
    assert (info.pooler.method, info.pooler.normalize, info.max_seq_length) == (method, True, 128)
    info = read_sentence_transformer(str(_st_folder(tmp_path, {flag: True},
                                                    ["Transformer", "Pooling"])))
    assert info is not None and not info.pooler.normalize


@pytest.mark.parametrize(("pooling", "modules", "match"), [
    ({"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling", "Dense"], "Dense"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
     ["Transformer", "Pooling"], "exactly one pooling mode"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, ["Transformer", "Pooling"], "sqrt_len"),
    ({"pooling_mode_mean_tokens": True}, ["Transformer"], "no Pooling module"),
])
def test_unsupported_sentence_transformers_pipelines(tmp_path: Path, pooling: dict,
                                                     modules: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_sentence_transformer(str(_st_folder(tmp_path, pooling, modules)))


def _make_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json"):
            z.writestr(name, name * 1000)
    return path


def _extract(args: tuple[str, str]) -> str:
    return str(extract_once(Path(args[0]), Path(args[1])))


def test_extraction_is_safe_when_two_processes_race(tmp_path: Path) -> None:
    archive = _make_zip(tmp_path / "model.zip")
    target = tmp_path / "cache" / "model"
    with multiprocessing.get_context("spawn").Pool(2) as pool_:
        paths = pool_.map(_extract, [(str(archive), str(target))] * 8)
    assert set(paths) == {str(target)}
    assert (target / "tokenizer.json").read_text() == "tokenizer.json" * 1000
    # Only the target is left: every temporary copy was renamed or removed.
    assert [p.name for p in target.parent.iterdir()] == ["model"]
    mtime = (target / "config.json").stat().st_mtime_ns
    extract_once(archive, target)  # already there: nothing is written again
    assert (target / "config.json").stat().st_mtime_ns == mtime
