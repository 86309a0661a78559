"""CUDA-side choices that can be checked without a GPU: KV sizing by gpu_memory_utilization,
the attention backend choice, the configuration's validation, the dummy presets."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import CacheConfig, DeviceConfig, ModelConfig
from tokenmill.runner.kv_memory import plan_kv_cache
from tokenmill.runner.platform import Platform
from tokenmill.utils import host_tensor

GIB = 1 << 30


class FakeCuda:
    """torch.cuda's memory queries of an 80 GiB GPU; ``profile`` raises the peak."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, weights: int, activations: int,
                 context: int, other_processes: int = 0) -> None:
        self.total = 80 * GIB
        self.allocated = weights
        self.peak = weights
        self.activations = activations
        self.context = context
        self.other = other_processes
        for name in ("empty_cache", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda *a: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (
            self.total - self.allocated - self.context - self.other, self.total))

    def profile(self) -> None:
        self.peak = self.allocated + self.activations


def test_gpu_memory_utilization_leaves_weights_activations_and_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch, weights=16 * GIB, activations=2 * GIB, context=GIB // 2)
    platform = Platform(torch.device("cuda"))
    budget = platform.kv_cache_budget(0.9, fake.profile)
    assert budget == int(80 * GIB * 0.9) - 18 * GIB - GIB // 2
    # Through plan_kv_cache: whole blocks of that budget.
    plan = plan_kv_cache(CacheConfig(gpu_memory_utilization=0.9), platform, 2 << 20, 8192,
                         profiled_budget=budget)
    assert plan.num_blocks == budget // (2 << 20)
    # Explicit sizes still win over the utilization.
    plan = plan_kv_cache(CacheConfig(num_blocks=100), platform, 2 << 20, 8192,
                         profiled_budget=budget)
    assert plan.num_blocks == 100


def test_profiling_applies_to_cuda_without_an_explicit_size() -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.runner.kv_memory import profiled_kv_budget

    class Runner:  # profiled_kv_budget only looks at the platform before profiling
        platform = Platform(torch.device("cpu"))

    assert profiled_kv_budget(Runner(), EngineConfig(), 4096) is None  # type: ignore[arg-type]
    Runner.platform = Platform(torch.device("cuda"))
    sized = EngineConfig(cache=CacheConfig(num_blocks=10))
    assert profiled_kv_budget(Runner(), sized, 4096) is None  # type: ignore[arg-type]


def test_other_processes_memory_counts_against_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch, weights=16 * GIB, activations=GIB, context=GIB,
                    other_processes=40 * GIB)
    budget = Platform(torch.device("cuda")).kv_cache_budget(0.9, fake.profile)
    assert budget == int(80 * GIB * 0.9) - 17 * GIB - 41 * GIB
    assert budget < 80 * GIB - 16 * GIB - GIB - 40 * GIB  # what is free


def test_gpu_memory_utilization_too_small_names_the_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch, weights=16 * GIB, activations=2 * GIB, context=GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 leaves no memory"):
        Platform(torch.device("cuda")).kv_cache_budget(0.2, fake.profile)


def test_cpu_platform_has_no_gpu_budget_and_uses_the_cpu_backend() -> None:
    cpu = Platform(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA devices only"):
        cpu.kv_cache_budget(0.9, lambda: None)
    # The extension builds in the test environment: prefill goes through its kernel.
    assert cpu.attention_backend().name == "cpu"


def test_cuda_platform_picks_the_triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    # The backend reads its GPU model's decode tuning; a CPU build of torch has no GPU name.
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert Platform(torch.device("cuda")).attention_backend().name == "triton"


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        DeviceConfig(cuda_graph_max_batch_size=0)
    with pytest.raises(ValueError, match="unknown model preset 'llama-9b'.*llama-3.1-8b"):
        ModelConfig(model="llama-9b", load_format="dummy")
    with pytest.raises(ValueError, match="neither a GGUF file"):
        ModelConfig(model="llama-3.1-8b")  # a preset needs load_format="dummy"


def test_presets_build_the_published_shapes() -> None:
    from tokenmill.models.config import ArchConfig
    from tokenmill.presets import get_preset

    llama = ArchConfig.from_hf_dict(get_preset("llama-3.1-8b"))
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.vocab_size) == (32, 32, 8, 128, 128256)
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    qwen = ArchConfig.from_hf_dict(get_preset("qwen3-0.6b"))
    assert (qwen.architecture, qwen.num_hidden_layers, qwen.hidden_size, qwen.head_dim,
            qwen.tie_word_embeddings) == ("Qwen3ForCausalLM", 28, 1024, 128, True)
    # 8.03B parameters, as published.
    h, i, v, n = 4096, 14336, 128256, 32
    params = 2 * v * h + n * (h * (h + 2 * 1024) + h * h + 3 * h * i + 2 * h) + h
    assert round(params / 1e9, 2) == 8.03


def test_dummy_preset_generates() -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model="tiny-llama", load_format="dummy", num_kv_blocks=32, max_model_len=128)
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_host_tensor_on_cpu() -> None:
    t = host_tensor([1, 2, 3], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [1, 2, 3]
