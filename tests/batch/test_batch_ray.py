"""The batch job on Ray Data, two local actors: the same answers as the single-process job."""

from __future__ import annotations

import pytest
from batch_helpers import ENGINE_KWARGS, by_custom_id, chat, completion, read_results, write_jsonl

from tokenmill.batch import run_batch, run_batch_ray
from tokenmill.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig


def _comparable(result: dict) -> dict:
    """A result without what differs between runs by design (random ids, timestamps, the
    measured compute, energy and cost in its usage)."""
    result = dict(result)
    if result["response"] is not None:
        body = {k: v for k, v in result["response"]["body"].items() if k not in ("id", "created")}
        if isinstance(body.get("usage"), dict):
            body["usage"] = {k: v for k, v in body["usage"].items() if k in TOKEN_COUNTS}
        result["response"] = {**result["response"], "request_id": None, "body": body}
    return result


TOKEN_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray", reason="ray[data] is not installed (the test extra has it)")
    pytest.importorskip("ray.data")
    # More logical CPUs than actors: Ray Data's own tasks must not wait behind the actors.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_job_on_two_actors_equals_the_single_process_job(tmp_path, small_llm, local_ray):
    lines = [completion(f"p{i}", f"Fact number {i}:", max_tokens=6) for i in range(10)]
    lines += [chat(f"c{i}", f"Give me word {i}.", max_tokens=6) for i in range(6)]
    lines += ["not json", completion("hot", "x", temperature="hot")]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)

    config = EngineConfig(
        model=ModelConfig(max_model_len=ENGINE_KWARGS["max_model_len"],
                          quantization=ENGINE_KWARGS["quantization"]),
        cache=CacheConfig(kv_cache_memory_bytes=ENGINE_KWARGS["kv_cache_memory_bytes"]),
        device=DeviceConfig())
    ray_out = tmp_path / "ray.jsonl"
    stats = run_batch_ray(str(inp), str(ray_out), config, num_actors=2, batch_size=4,
                          progress=False)
    assert (stats.succeeded, stats.failed) == (16, 2)

    ref_out = tmp_path / "ref.jsonl"
    run_batch(str(inp), str(ref_out), small_llm.engine, progress=False)
    ray_results = by_custom_id([_comparable(r) for r in read_results(ray_out)
                                if r["custom_id"] is not None])
    ref_results = by_custom_id([_comparable(r) for r in read_results(ref_out)
                                if r["custom_id"] is not None])
    assert ray_results == ref_results
    assert len(read_results(ray_out)) == len(lines)


def test_ray_job_resumes(tmp_path):
    """Lines answered before are not sent to actors again: here nothing is, and no Ray starts."""
    ray = pytest.importorskip("ray", reason="ray[data] is not installed (the test extra has it)")
    inp = write_jsonl(tmp_path / "in.jsonl", [completion("a", "x"), "not json"])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}\n'
                   '{"id": "batch_req_2", "custom_id": null, "response": null, "error": null}\n')
    stats = run_batch_ray(str(inp), str(out), EngineConfig(), num_actors=1, progress=False)
    assert (stats.skipped, stats.answered) == (2, 0)
    assert not ray.is_initialized()
