"""Metric names, labels and buckets that dashboards built for vLLM read (with tokenmill's
``tokenmill:`` prefix in place of ``vllm:``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats


def finished(reason: str, tokens: int, prefill: float, decode: float) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency=prefill + decode + 0.5,
                                queue_time=0.5, num_prompt_tokens=10,
                                num_generation_tokens=tokens, prefill_time=prefill,
                                decode_time=decode, inference_time=prefill + decode,
                                max_tokens=tokens)


def samples(metrics: PrometheusMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_vllm_names_labels_and_buckets() -> None:
    metrics = PrometheusMetrics()
    logger = metrics.for_model("m")
    logger.set_cache_config(16, 1000, "float32", True)
    it = IterationStats(batch_size=2, num_batched_tokens=40)
    it.finished = [finished("stop", 11, prefill=0.2, decode=1.0),
                   finished("length", 1, prefill=0.3, decode=0.0)]
    logger.record(SchedulerStats(), it)
    s = samples(metrics)
    success = {x.labels["finished_reason"]: x.value for x in s["tokenmill:request_success_total"]}
    assert success == {"stop": 1.0, "length": 1.0}
    assert all(x.labels["model_name"] == "m" for x in s["tokenmill:request_success_total"])
    # TPOT: decode time over the tokens after the first, for sequences with more than one.
    tpot = s["tokenmill:time_per_output_token_seconds_sum"][0].value
    assert abs(tpot - 0.1) < 1e-9 and s["tokenmill:time_per_output_token_seconds_count"][0].value == 1
    buckets = [x.labels["le"] for x in s["tokenmill:time_per_output_token_seconds_bucket"]]
    assert buckets[:4] == ["0.01", "0.025", "0.05", "0.075"] and buckets[-2:] == ["80.0", "+Inf"]
    for name, total in (("request_prefill_time_seconds", 0.5), ("request_decode_time_seconds",
                                                               1.0),
                        ("request_inference_time_seconds", 1.5)):
        assert abs(s[f"tokenmill:{name}_sum"][0].value - total) < 1e-9, name
        assert s[f"tokenmill:{name}_count"][0].value == 2
    phase = [x.labels["le"] for x in s["tokenmill:request_prefill_time_seconds_bucket"]]
    assert phase[0] == "0.3" and "7680.0" in phase
    assert s["tokenmill:iteration_tokens_total_sum"][0].value == 40
    assert s["tokenmill:request_params_max_tokens_sum"][0].value == 12
    info = s["tokenmill:cache_config_info"][0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "1000" and info.labels["enable_prefix_caching"] == "True"


def test_a_sequence_that_never_ran_has_no_phases() -> None:
    metrics = PrometheusMetrics()
    logger = metrics.for_model("m")
    it = IterationStats()
    it.finished = [FinishedRequestStats("abort", None, None, 10, 0)]
    logger.record(SchedulerStats(), it)
    s = samples(metrics)
    assert s["tokenmill:request_prefill_time_seconds_count"][0].value == 0
    assert s["tokenmill:time_per_output_token_seconds_count"][0].value == 0
    assert s["tokenmill:request_success_total"][0].labels["finished_reason"] == "abort"


def test_stats_line_when_busy_and_silence_when_idle(caplog) -> None:
    import logging

    from tokenmill.metrics.log_stats import LoggingStatLogger

    now = [0.0]
    stats = LoggingStatLogger("m", 10.0, clock=lambda: now[0])
    busy = SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                          prefix_cache_queries_total=100, prefix_cache_hits_total=40)
    with caplog.at_level(logging.INFO, logger="tokenmill.stats"):
        for _ in range(5):  # 5 steps over 10 s: 500 prompt and 50 generated tokens
            now[0] += 2.0
            stats.record(busy, IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
        assert len(caplog.records) == 1
        line = caplog.records[0].getMessage()
        assert line == ("m: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: "
                        "5.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                        "Prefix cache hit rate: 40.0%")
        caplog.clear()
        idle = SchedulerStats()
        now[0] += 10.0
        stats.record(idle, IterationStats())  # the requests left: one line says so
        assert len(caplog.records) == 1 and "Running: 0 reqs" in caplog.records[0].getMessage()
        caplog.clear()
        for _ in range(5):  # nothing happens: nothing is logged
            now[0] += 10.0
            stats.record(idle, IterationStats())
        assert not caplog.records


def test_lora_requests_info() -> None:
    """vLLM's lora_requests_info: the adapters in the labels, one sample per model at a time;
    an engine without LoRA has none."""
    metrics = PrometheusMetrics()
    plain, served = metrics.for_model("plain"), metrics.for_model("m")
    plain.record(SchedulerStats(), IterationStats())
    served.record(SchedulerStats(running_loras=("a", "b"), waiting_loras=("c",), max_loras=2),
                  IterationStats())
    served.record(SchedulerStats(running_loras=("c",), max_loras=2), IterationStats())
    info = samples(metrics)["tokenmill:lora_requests_info"]
    assert [x.labels for x in info] == [{"model_name": "m", "running_lora_adapters": "c",
                                         "waiting_lora_adapters": "", "max_lora": "2"}]
    assert info[0].value > 1e9  # a Unix time
