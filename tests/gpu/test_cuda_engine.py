"""The engine on a real GPU: bf16/fp16, Triton attention, CUDA graphs, quantized layers, KV
sizing from gpu_memory_utilization. Every test here skips without CUDA (CI has none)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


def _free_cuda_memory() -> None:
    """Give back what dropped engines held (they may sit in reference cycles)."""
    gc.collect()
    torch.cuda.empty_cache()


def _generate(**kwargs: object) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(device="cuda", max_model_len=512, **kwargs)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_give_the_eager_tokens(dtype: str) -> None:
    eager = _generate(dtype=dtype, enforce_eager=True, quantization="none")
    graphs = _generate(dtype=dtype, quantization="none")
    assert graphs == eager


def test_bf16_on_cuda_agrees_with_fp32_on_cpu() -> None:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    cpu = LLM(device="cpu", dtype="float32", quantization="none", max_model_len=512)
    want = [o.outputs[0].token_ids[:4] for o in cpu.generate(PROMPTS, params)]
    got = [ids[:4] for ids in _generate(dtype="bfloat16", quantization="none")]
    # bf16 rounding may flip a near tie late in a sequence; the first tokens agree.
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 3


def test_triton_backend_matches_torch_backend_on_cuda() -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention.backend import TorchAttentionBackend

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(device="cuda", dtype="float32", quantization="none", enforce_eager=True,
              max_model_len=512)
    assert llm.engine.core.executor.runner.backend.name == "triton"
    triton_out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    llm.engine.core.executor.runner.backend = TorchAttentionBackend()
    torch_out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert triton_out == torch_out


def _qwen3_greedy(prompts: list[str], max_tokens: int, max_num_seqs: int = 8) -> list:
    """Each prompt's greedy completion (with the sampled tokens' logprobs) on dummy weights of
    Qwen3-0.6B's shape, bf16, CUDA graphs; the engine is closed and its memory freed after."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=256, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.close()
    del llm
    _free_cuda_memory()
    return outs


def _first_decode_step(prompts: list[str]) -> tuple[list[int], list[float]]:
    """Each prompt's first token (the prefill's) and the logprob of its second (the first
    decode step's), greedy on Qwen3-0.6B's shape (:func:`_qwen3_greedy`)."""
    outs = _qwen3_greedy(prompts, max_tokens=2)
    return [o.token_ids[0] for o in outs], [o.logprobs[1].logprob for o in outs]


def test_tuned_triton_matmul_in_cuda_graphs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuning file that sends every 16-bit product of up to 16 rows to the Triton matmul
    (the decode steps' linears, the head, the down projection with its SiLU prologue, qkv
    and gate_up with their norms in theirs), captured in the CUDA graphs: the first decode
    step's logprobs agree with cuBLAS's to bf16's rounding (the prefills' layers, of more
    rows, are cuBLAS's in both)."""
    import json

    from tokenmill.kernels.triton import gemm as triton_gemm
    from tokenmill.models import linear

    prompts = PROMPTS * 2  # more than 16 prompt tokens in the prefill step
    first, want = _first_decode_step(prompts)
    tuning = tmp_path / "gemm.json"
    tuning.write_text(json.dumps({"gemm": [{"max_m": 16, "block_m": 16, "block_n": 32,
                                            "block_k": 256, "num_warps": 4,
                                            "num_stages": 4}]}))
    monkeypatch.setenv(triton_gemm.ENV_FILE, str(tuning))
    triton_gemm.tuning_for_device.cache_clear()
    linear._gemm_tuning.cache_clear()
    launches: list[str | None] = []
    matmul = triton_gemm.matmul

    def counted(*args, silu_mul: bool = False, norm=None):
        launches.append("silu" if silu_mul else None if norm is None else "norm")
        return matmul(*args, silu_mul=silu_mul, norm=norm)

    monkeypatch.setattr(triton_gemm, "matmul", counted)
    try:
        first_tuned, got = _first_decode_step(prompts)
    finally:
        triton_gemm.tuning_for_device.cache_clear()
        linear._gemm_tuning.cache_clear()
    assert {"silu", "norm", None} <= set(launches)  # both prologues and plain products
    # The head's product of the prefill's last rows (8 rows) is Triton's too: a near tie of
    # random weights' logits may flip a first token; the decode step is compared where not.
    same = [i for i, (a, b) in enumerate(zip(first_tuned, first, strict=True)) if a == b]
    assert len(same) >= 6
    assert max(abs(got[i] - want[i]) for i in same) <= 0.05


def test_gpu_memory_utilization_bounds_the_engine() -> None:
    from tokenmill import LLM

    total = torch.cuda.get_device_properties(0).total_memory
    plans = {}
    for util in (0.3, 0.6):
        _free_cuda_memory()  # engines of earlier tests hold memory the budget would count
        plans[util] = LLM(device="cuda", gpu_memory_utilization=util,
                          quantization="none").engine.core.kv_plan
    assert 1 < plans[0.3].num_blocks < plans[0.6].num_blocks
    assert plans[0.3].total_bytes < 0.3 * total


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_quantized_linear_on_cuda(method: str, rows: int) -> None:
    from tokenmill.quant import quantize_weight
    from tokenmill.quant.fp8 import fp8_supported

    if method == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(512, 1024, device="cuda", generator=gen) * 0.02
    x = torch.randn(rows, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
    m = quantize_weight(w, None, method)
    y = m(x)
    ref = F.linear(x.float(), m.dequantize())
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.05
    assert ((m.dequantize() - w).norm() / w.norm()).item() < {"int8": 0.01, "int4": 0.12,
                                                              "fp8": 0.05}[method]


TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, museums such as the "
        "Louvre, and its cafes. Many tourists visit every year.")


def _prompt_logprobs(quantization: str) -> list[float]:
    """The embedded model's logprob of each token of TEXT after the ones before it (bf16)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(device="cuda", dtype="bfloat16", quantization=quantization, max_model_len=256,
              num_kv_blocks=32)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([TEXT], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24
    llm.engine.close()
    del llm
    _free_cuda_memory()
    return [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_engine_on_cuda(method: str) -> None:
    """The quantized engine reads the text as the unquantized one does, to the weights'
    rounding: on the CPU in fp32, int8 and int4 move these logprobs by 0.06 and 0.04 nats on
    average (a wrong scale or layout moves them by whole nats)."""
    from tokenmill.quant.fp8 import fp8_supported

    if method == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    want = _prompt_logprobs("none")
    got = _prompt_logprobs(method)
    assert len(got) == len(want) > 20
    assert sum(abs(g - w) for g, w in zip(got, want, strict=True)) / len(want) < 0.3


def test_step_logits_stay_in_the_heads_dtype() -> None:
    """A CUDA step's logits reach the greedy kernel in bf16 (no fp32 copy of them), and its
    tokens and logprobs are those of the fp32 logits."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.runner.sampler import logprobs_of

    llm = LLM(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True)
    runner = llm.engine.core.executor.runner
    greedy, seen = runner.sampler.greedy, []

    def spy(logits: torch.Tensor):  # noqa: ANN202
        out = greedy(logits)
        seen.append((logits.dtype, logits.float().argmax(-1), logprobs_of(
            logits.float(), out.sampled_token_ids), out))
        return out

    runner.sampler.greedy = spy
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.close()
    assert seen and all(dtype == torch.bfloat16 for dtype, *_ in seen)
    for _, want, want_lps, out in seen:
        assert torch.equal(out.sampled_token_ids, want)
        torch.testing.assert_close(out.chosen_logprobs, want_lps, rtol=1e-4, atol=1e-4)
    del llm
    _free_cuda_memory()


def test_requests_are_charged_the_gpus_joules() -> None:
    """On a GPU machine the meter reads the GPU's energy counter (NVML, through Zeus), and
    every request gets a share of the joules it was computed in."""
    from tokenmill import LLM, SamplingParams

    pytest.importorskip("zeus")
    llm = LLM(model="tiny-llama", load_format="dummy", device="cuda", max_model_len=256,
              num_kv_blocks=64)
    meter = llm.engine.core.accountant.meter
    assert "gpu" in meter.sources
    before = meter.read()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["The capital of France is"] * 8, params, use_tqdm=False)
    spent = meter.read() - before
    charged = [o.metrics.usage.energy_joules for o in outs]
    assert spent > 0 and all(j > 0 for j in charged)
    assert sum(charged) <= spent * 1.01
    llm.engine.close()
    del llm
    _free_cuda_memory()


def test_pdl_keeps_the_tokens(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_PDL=1 (tokenmill/kernels/triton/pdl.py): every Triton kernel launched with programmatic
    dependent launch, in the CUDA graphs and in the eager prefills, the decode steps' matmuls
    too (a tuning file sends them to the Triton matmul, so that a whole layer is a chain of
    kernels that wait for each other), gives the tokens and logprobs of the same run without
    it."""
    import json

    from tokenmill.kernels.triton import gemm as triton_gemm
    from tokenmill.kernels.triton import pdl
    from tokenmill.models import linear

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    tuning = tmp_path / "gemm.json"
    tuning.write_text(json.dumps({"gemm": [{"max_m": 16, "block_m": 16, "block_n": 32,
                                            "block_k": 256, "num_warps": 4,
                                            "num_stages": 4}]}))
    monkeypatch.setenv(triton_gemm.ENV_FILE, str(tuning))

    def run() -> list[tuple[list[int], list[float]]]:
        pdl.reset()
        triton_gemm.tuning_for_device.cache_clear()
        linear._gemm_tuning.cache_clear()
        outs = _qwen3_greedy(PROMPTS, max_tokens=24, max_num_seqs=16)
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    try:
        want = run()
        monkeypatch.setenv(pdl.ENV, "1")
        pdl.reset()
        assert pdl.launch_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
        got = run()
    finally:
        monkeypatch.delenv(pdl.ENV, raising=False)
        monkeypatch.delenv(triton_gemm.ENV_FILE, raising=False)
        pdl.reset()
        triton_gemm.tuning_for_device.cache_clear()
        linear._gemm_tuning.cache_clear()
    assert [t for t, _ in got] == [t for t, _ in want]
    # The same kernels on the same inputs: the waits change when they run, not what they do.
    assert got == want


def test_l2_prefetch_is_captured_and_keeps_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_L2_PREFETCH (tokenmill/runner/l2_prefetch.py): the small batches' graphs
    read the next matmul's weights on a side stream, and the tokens stay those without."""
    from tokenmill.runner import l2_prefetch

    def tokens() -> list[list[int]]:
        return [o.token_ids for o in _qwen3_greedy(PROMPTS, max_tokens=24, max_num_seqs=16)]

    want = tokens()
    reads = []
    touch = l2_prefetch.touch_prefix

    def counted(weight: torch.Tensor, max_bytes: int, out: torch.Tensor) -> None:
        reads.append(torch.cuda.is_current_stream_capturing())
        touch(weight, max_bytes, out)

    monkeypatch.setattr(l2_prefetch, "touch_prefix", counted)
    monkeypatch.setenv(l2_prefetch.ENV, "8")
    got = tokens()
    assert sum(reads) > 0  # read inside captures: one graph per small batch size
    assert got == want
