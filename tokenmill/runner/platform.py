"""Device specifics behind one small object: dtype choice, memory, threads, attention backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.runner.cpu_program import make_cpu_program, make_invariant_program
from tokenmill.runner.step_backend import (
    CpuProgramBackend,
    EagerBackend,
    InvariantCpuProgramBackend,
    StepBackend,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Platform:
    """The device the model runs on and the choices that depend on it."""

    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """The compute dtype for a configured name; "auto" picks fast-and-exact-enough.

        On the CPU that is float32: at batch 1 bf16 matmuls are barely faster here and
        bf16 logits would drift from the reference. On CUDA it is bf16 where supported.
        """
        if dtype != "auto":
            return _DTYPES[dtype]
        if self.is_cuda:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def resolve_kv_cache_dtype(self, kv_cache_dtype: str, dtype: torch.dtype,
                               quantized: bool) -> torch.dtype:
        """The KV cache's dtype for the configured name, under activations in ``dtype``.

        "auto" is ``dtype``, except fp16 for a quantized model with fp32 activations on the
        CPU: its K and V come out of bf16 projections, which fp16 holds exactly (rope rounds
        k once more, 2^-11 relative), in half the memory. A dtype other than the model's is
        CPU-only: the CUDA attention kernels read the cache in the activations' dtype.
        """
        if kv_cache_dtype == "auto":
            if not self.is_cuda and quantized and dtype == torch.float32:
                return torch.float16
            return dtype
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            if not self.is_cuda:
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs a CUDA GPU (the "
                                 "Triton attention kernels read it); on the CPU float16 halves "
                                 "a float32 cache")
            capability = torch.cuda.get_device_capability(self.device)
            if capability < (8, 9):
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs a GPU of compute "
                                 f"capability 8.9 or later (fp8 e4m3); this one is "
                                 f"{capability[0]}.{capability[1]}")
            return torch.float8_e4m3fn
        chosen = _DTYPES[kv_cache_dtype]
        if self.is_cuda and chosen != dtype:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's dtype "
                             f"({str(dtype).removeprefix('torch.')}): on CUDA the KV cache is "
                             "kept in the model's dtype")
        return chosen

    def available_memory(self) -> int:
        """Bytes of device memory free now."""
        if self.is_cuda:
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        return _host_available_memory()

    def kv_cache_budget(self, gpu_memory_utilization: float, profile: Callable[[], None]) -> int:
        """Bytes the KV cache may take on CUDA so the engine stays within
        ``gpu_memory_utilization`` of the GPU's total memory.

        ``profile`` runs the largest step the engine will run (without a KV cache of real
        size); its peak, which counts the weights already loaded, plus all memory in use
        outside PyTorch's allocator (the CUDA context, cuBLAS and NCCL workspaces, and other
        processes on the same GPU) is subtracted.
        """
        if not self.is_cuda:
            raise ValueError("gpu_memory_utilization applies to CUDA devices only")
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        profile()
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        non_torch = max(total - free - torch.cuda.memory_reserved(dev), 0)
        torch.cuda.empty_cache()
        budget = int(total * gpu_memory_utilization) - peak - non_torch
        logger.info("GPU memory: %.1f GiB total, peak %.2f GiB in PyTorch (weights and "
                    "activations), %.2f GiB outside it; KV cache budget %.2f GiB",
                    total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV "
                f"cache: the model and its activations take {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.1f} GiB; raise it or shorten max_num_batched_tokens")
        # Other processes may hold memory too: never plan past what is free now.
        return min(budget, int(free * 0.98))

    def attention_backend(self) -> AttentionBackend:
        """The attention implementation for this device: Triton kernels on CUDA (when Triton is
        installed, as it is with CUDA builds of PyTorch); on the CPU PyTorch's, with prefill
        through the C++ extension's kernel where it builds."""
        if self.is_cuda:
            try:
                from tokenmill.attention.triton_backend import TritonAttentionBackend
            except ImportError as e:
                logger.warning("Triton is not available (%s): CUDA attention runs on the "
                               "PyTorch backend, without CUDA graphs", e)
            else:
                from tokenmill.kernels.tuning.decode_attention import tuning_for_device

                # Read at start-up, so a bad tuning file stops the engine before it serves.
                return TritonAttentionBackend(decode_tuning=tuning_for_device(
                    torch.cuda.get_device_name(self.device)))
            return TorchAttentionBackend()
        from tokenmill.attention.cpu_backend import cpu_attention_backend

        return cpu_attention_backend()

    def step_backend(self, eager: EagerBackend, *, deterministic: bool = False,
                     cpu_program: bool | None = None, tensor_parallel_size: int = 1,
                     is_encoder: bool = False) -> StepBackend:
        """The engine's one step backend besides ``eager`` (``model.forward``), picked at
        start: deterministic, the CPU program taking every step (ValueError where it cannot
        run the model); on the CPU, the CPU program where it runs the model (``cpu_program``
        None defers to $TOKENMILL_FUSED_DECODE, its prefill steps to
        $TOKENMILL_FUSED_PREFILL); else ``eager``. An encoder and tensor parallelism (the C++
        program has no all-reduce between layers) run eagerly. On CUDA the decode graphs
        replace ``eager`` once captured (:meth:`captures_decode_graphs`)."""
        model = eager.model
        if is_encoder:
            return eager
        if deterministic:
            return InvariantCpuProgramBackend(make_invariant_program(model, self.device))
        if tensor_parallel_size > 1:
            return eager
        program = make_cpu_program(model, self.device, cpu_program)
        return CpuProgramBackend(program) if program is not None else eager

    def captures_decode_graphs(self, attention: AttentionBackend, enforce_eager: bool) -> bool:
        """Whether decode steps run as captured CUDA graphs: on CUDA, not ``enforce_eager``,
        under an attention backend whose kernels can be captured."""
        return (self.is_cuda and not enforce_eager
                and bool(getattr(attention, "supports_cuda_graphs", False)))

    def set_num_threads(self, num_threads: int | None) -> None:
        """Use every core we may run on unless told otherwise (CPU only)."""
        if self.is_cuda:
            return
        if num_threads is None:
            try:
                num_threads = len(os.sched_getaffinity(0))
            except AttributeError:  # not on Linux
                num_threads = os.cpu_count() or 1
        torch.set_num_threads(num_threads)

    def set_kernel_spin_us(self, us: int | None) -> None:
        """How long the C++ kernels' workers spin between calls (CPU only; None: default)."""
        if self.is_cuda or us is None:
            return
        from tokenmill.kernels.cpu import set_kernel_spin_us

        set_kernel_spin_us(us)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def _host_available_memory() -> int:
    """Bytes of host memory free now: Linux's MemAvailable, else the free pages; where the
    system tells neither (macOS has no SC_AVPHYS_PAGES), half the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def get_platform(device: str = "auto") -> Platform:
    """The Platform for a configured device name ("auto", "cpu", "cuda", "cuda:N")."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return Platform(torch.device(device))
