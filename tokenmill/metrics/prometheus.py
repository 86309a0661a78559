"""Prometheus exposition of the engine's statistics (metric names prefixed ``tokenmill:``)."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tokenmill.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)
from tokenmill.outputs import ComputeUsage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's buckets for its per-output-token and request-phase histograms, so dashboards built
# for vLLM read these the same way.
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# attribute -> (kind, metric name without "tokenmill:", help, histogram buckets). Every family
# is labelled by model_name; the per-model loggers bind that label.
_FAMILIES: dict[str, tuple[str, str, str, tuple[float, ...]]] = {
    "num_running": ("gauge", "num_requests_running", "Sequences in the running batch.", ()),
    "num_waiting": ("gauge", "num_requests_waiting", "Sequences waiting to be scheduled.", ()),
    "kv_usage": ("gauge", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                 ()),
    "preemptions": ("counter", "num_preemptions", "Sequences preempted for lack of blocks.", ()),
    "prefix_queries": ("counter", "prefix_cache_queries",
                       "Prompt tokens looked up in the prefix cache.", ()),
    "prefix_hits": ("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                    ()),
    "prefix_hit_rate": ("gauge", "prefix_cache_hit_rate",
                        "Prefix-cache hits / queries since the start (0-1).", ()),
    "prompt_tokens": ("counter", "prompt_tokens", "Prompt tokens prefilled.", ()),
    "generation_tokens": ("counter", "generation_tokens", "Tokens generated.", ()),
    "ttft": ("histogram", "time_to_first_token_seconds", "Time to first token.",
             _LATENCY_BUCKETS),
    "itl": ("histogram", "inter_token_latency_seconds", "Time between output tokens.",
            _LATENCY_BUCKETS),
    "e2e": ("histogram", "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS),
    "queue_time": ("histogram", "request_queue_time_seconds", "Arrival to first scheduled.",
                   _REQUEST_BUCKETS),
    "prompt_len": ("histogram", "request_prompt_tokens",
                   "Prompt length of finished sequences.", _TOKEN_BUCKETS),
    "gen_len": ("histogram", "request_generation_tokens", "Output length of finished sequences.",
                _TOKEN_BUCKETS),
    "batch_size": ("histogram", "iteration_batch_size", "Sequences computed per engine step.",
                   _BATCH_BUCKETS),
    "batch_tokens": ("histogram", "iteration_tokens_total", "Tokens computed per engine step "
                     "(vLLM's name).", _TOKEN_BUCKETS),
    "tpot": ("histogram", "time_per_output_token_seconds",
             "Decode time per output token after the first, per finished sequence.",
             _TPOT_BUCKETS),
    "prefill_time": ("histogram", "request_prefill_time_seconds",
                     "First scheduled to first token.", _PHASE_BUCKETS),
    "decode_time": ("histogram", "request_decode_time_seconds", "First token to finish.",
                    _PHASE_BUCKETS),
    "inference_time": ("histogram", "request_inference_time_seconds",
                       "First scheduled to finish.", _PHASE_BUCKETS),
    "max_tokens_param": ("histogram", "request_params_max_tokens",
                         "The max_tokens of finished sequences that set one.", _TOKEN_BUCKETS),
    "compute_seconds": ("counter", "compute_seconds", "Seconds of engine steps.", ()),
    "energy_joules": ("counter", "energy_joules", "Energy of engine steps (J; estimated where "
                      "the machine has no energy counter: see energy_estimated).", ()),
    "cost_usd": ("counter", "cost_usd", "Cost of engine steps (USD, --cost-per-hour).", ()),
    "joules_per_output_token": ("gauge", "joules_per_output_token",
                                "Energy per generated token since the start (J).", ()),
    "energy_estimated": ("gauge", "energy_estimated",
                         "1 when the energy is estimated from CPU time, 0 when measured.", ()),
    "spec_drafts": ("counter", "spec_decode_num_drafts",
                    "Speculative proposals verified (one per request and step).", ()),
    "spec_draft_tokens": ("counter", "spec_decode_num_draft_tokens", "Draft tokens verified.",
                          ()),
    "spec_accepted_tokens": ("counter", "spec_decode_num_accepted_tokens",
                             "Draft tokens accepted.", ()),
}


class PrometheusMetrics:
    """The metric families of one server in a registry of their own (no process globals);
    ``for_model`` gives each served model its logger, every sample labelled by model_name."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.families: dict[str, Gauge | Counter | Histogram] = {}
        for attr, (kind, name, doc, buckets) in _FAMILIES.items():
            full = f"tokenmill:{name}"
            if kind == "gauge":
                self.families[attr] = Gauge(full, doc, ["model_name"], registry=r)
            elif kind == "counter":
                self.families[attr] = Counter(full, doc, ["model_name"], registry=r)
            else:
                self.families[attr] = Histogram(full, doc, ["model_name"], buckets=buckets,
                                                registry=r)
        # vLLM's name and label, so its dashboards read it.
        self.finished = Counter("tokenmill:request_success",
                                "Finished sequences by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=r)
        self.cache_config = Gauge("tokenmill:cache_config_info",
                                  "The KV cache's configuration (value 1, in the labels).",
                                  ["model_name", "block_size", "num_gpu_blocks",
                                   "cache_dtype", "enable_prefix_caching"], registry=r)
        self.drift_score = Gauge("tokenmill:drift_score",
                                 "Drift of a signal's live window from its reference "
                                 "(PSI; cosine distance for prompt_embedding).",
                                 ["model_name", "signal"], registry=r)
        self.spec_accepted_per_pos = Counter(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0-based).",
            ["model_name", "position"], registry=r)
        # vLLM's lora_requests_info: the adapters in use, in the labels; the value is when
        # they were last seen (Unix time).
        self.lora_info = Gauge("tokenmill:lora_requests_info",
                               "LoRA adapters of the running and waiting requests (comma-"
                               "separated), and the adapters a step may run; the value is "
                               "the time of the update.",
                               ["model_name", "running_lora_adapters", "waiting_lora_adapters",
                                "max_lora"], registry=r)

    def for_model(self, model_name: str) -> PrometheusStatLogger:
        """The stat logger of one served model."""
        return PrometheusStatLogger(model_name, self)

    def _all_families(self) -> list[Gauge | Counter | Histogram]:
        return [*self.families.values(), self.finished, self.cache_config, self.drift_score,
                self.spec_accepted_per_pos, self.lora_info]

    def forget(self, model_name: str, family: Gauge | Counter | Histogram | None = None) -> None:
        """Remove every series of ``model_name`` (of one ``family``, or of all): a model
        that is unloaded is no longer scraped as if it were still served."""
        for fam in [family] if family is not None else self._all_families():
            for labels in series_of(fam, model_name):
                fam.remove(*labels)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def series_of(family: Gauge | Counter | Histogram, model_name: str) -> list[tuple[str, ...]]:
    """The label values of each series of ``family`` that belongs to ``model_name``."""
    names = family._labelnames  # prometheus_client lists no children otherwise
    found: set[tuple[str, ...]] = set()
    for metric in family.collect():
        for sample in metric.samples:
            if sample.labels.get("model_name") == model_name:
                found.add(tuple(sample.labels[n] for n in names))
    return sorted(found)


class PrometheusStatLogger:
    """One model's metrics, fed by ``record`` (in ``metrics``' families, or in families of its
    own when none are given).

    ``record`` runs on the engine thread and ``render`` on the HTTP side: prometheus_client's
    metric objects are thread-safe.
    """

    num_running: Gauge
    num_waiting: Gauge
    kv_usage: Gauge
    preemptions: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    prefix_hit_rate: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    prompt_len: Histogram
    gen_len: Histogram
    batch_size: Histogram
    batch_tokens: Histogram
    tpot: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    inference_time: Histogram
    max_tokens_param: Histogram
    compute_seconds: Counter
    energy_joules: Counter
    cost_usd: Counter
    joules_per_output_token: Gauge
    energy_estimated: Gauge
    spec_drafts: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter

    def __init__(self, model_name: str, metrics: PrometheusMetrics | None = None) -> None:
        self.metrics = metrics if metrics is not None else PrometheusMetrics()
        for attr, family in self.metrics.families.items():
            setattr(self, attr, family.labels(model_name))
        self.finished = self.metrics.finished
        self.spec_accepted_per_pos = self.metrics.spec_accepted_per_pos
        self._model_name = model_name
        # Running totals already turned into counter increments.
        self._seen = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}
        self._spec_seen = SpecDecodingStats()
        self._usage_seen = ComputeUsage()
        self._output_tokens = 0
        # The labels of this model's lora_requests_info sample (one at a time).
        self._lora_labels: tuple[str, ...] | None = None

    def _record_loras(self, scheduler: SchedulerStats) -> None:
        """One lora_requests_info sample for the model: the old one goes when the adapters
        change, so the family does not grow a sample per combination ever seen."""
        family = self.metrics.lora_info
        labels = (self._model_name, ",".join(scheduler.running_loras),
                  ",".join(scheduler.waiting_loras), str(scheduler.max_loras))
        if self._lora_labels is not None and self._lora_labels != labels:
            family.remove(*self._lora_labels)
        self._lora_labels = labels
        family.labels(*labels).set(time.time())

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        """Take one step's statistics and the scheduler's state after it."""
        self.num_running.set(scheduler.num_running)
        self.num_waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_cache_usage)
        # The scheduler reports running totals; counters only go up by deltas.
        for key, total in (("preemptions", scheduler.num_preemptions_total),
                           ("prefix_queries", scheduler.prefix_cache_queries_total),
                           ("prefix_hits", scheduler.prefix_cache_hits_total)):
            if total > self._seen[key]:
                getattr(self, key).inc(total - self._seen[key])
                self._seen[key] = total
        if scheduler.prefix_cache_queries_total:
            self.prefix_hit_rate.set(scheduler.prefix_cache_hits_total
                                     / scheduler.prefix_cache_queries_total)
        if scheduler.spec_decoding is not None:
            self._record_spec(scheduler.spec_decoding)
        if scheduler.max_loras:
            self._record_loras(scheduler)
        self._record_usage(scheduler.usage_total, iteration.num_generation_tokens)
        if iteration.batch_size:
            self.batch_size.observe(iteration.batch_size)
            self.batch_tokens.observe(iteration.num_batched_tokens)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for t in iteration.time_to_first_tokens:
            self.ttft.observe(t)
        for t in iteration.inter_token_latencies:
            self.itl.observe(t)
        for f in iteration.finished:
            self.finished.labels(self._model_name, f.finish_reason).inc()
            if f.e2e_latency is not None:
                self.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)
            self.prompt_len.observe(f.num_prompt_tokens)
            self.gen_len.observe(f.num_generation_tokens)
            self._record_phases(f)

    def _record_phases(self, f: FinishedRequestStats) -> None:
        """vLLM's request-phase histograms of one finished sequence."""
        for hist, seconds in ((self.prefill_time, f.prefill_time),
                              (self.decode_time, f.decode_time),
                              (self.inference_time, f.inference_time)):
            if seconds is not None:
                hist.observe(seconds)
        if f.max_tokens is not None:
            self.max_tokens_param.observe(f.max_tokens)
        if f.decode_time is not None and f.num_generation_tokens > 1:
            self.tpot.observe(f.decode_time / (f.num_generation_tokens - 1))

    def set_cache_config(self, block_size: int, num_blocks: int, dtype: str,
                         prefix_caching: bool) -> None:
        """Publish the KV cache's configuration (vLLM's cache_config_info): one sample per
        model, so a new version (a swap) replaces the old one's."""
        self.metrics.forget(self._model_name, self.metrics.cache_config)
        self.metrics.cache_config.labels(self._model_name, str(block_size), str(num_blocks),
                                         dtype, str(prefix_caching)).set(1)

    def _record_usage(self, total: ComputeUsage, new_output_tokens: int) -> None:
        """Counters go up by the change in the engine's totals of step time, energy, cost."""
        seen = self._usage_seen
        for counter, now, before in ((self.compute_seconds, total.compute_seconds,
                                      seen.compute_seconds),
                                     (self.energy_joules, total.energy_joules,
                                      seen.energy_joules),
                                     (self.cost_usd, total.cost_usd, seen.cost_usd)):
            if now > before:
                counter.inc(now - before)
        self._usage_seen = total.copy()
        self._output_tokens += new_output_tokens
        if self._output_tokens:
            self.joules_per_output_token.set(total.energy_joules / self._output_tokens)
        self.energy_estimated.set(1.0 if total.energy_estimated else 0.0)

    def _record_spec(self, totals: SpecDecodingStats) -> None:
        """Counters go up by the change in the engine's running totals."""
        seen = self._spec_seen
        self.spec_drafts.inc(totals.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(totals.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(totals.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, count in enumerate(totals.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                self.spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(count - before)
        self._spec_seen = totals.copy()

    def render(self) -> tuple[bytes, str]:
        """The exposition text (of every model sharing the families) and its content type."""
        return self.metrics.render()
