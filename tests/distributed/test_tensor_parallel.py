"""Tensor parallelism on the CPU: two gloo processes must compute what one process does.

Each tensor-parallel engine starts one worker process (rank 1) next to the test process
(rank 0); the sharded layers themselves are also checked in two spawned processes against
the whole model.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
import torch
from hf_checkpoints import load_ours
from tp_helpers import ShardJob, run_sharded, two_step_logits

from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser
from tokenmill.config import EngineConfig, ParallelConfig, SpeculativeConfig
from tokenmill.distributed import tp_size
from tokenmill.engine.args import engine_config_from_args
from tokenmill.executor.tensor_parallel import WorkerDiedError, check_parallel_config
from tokenmill.quant import quantize_model

# Three prompts of different lengths; with 16 batched tokens a step, their prefills take
# several chunked steps and mix with the first decodes.
PROMPTS = [
    [5, 9, 33, 100, 7],
    [40 + (i * 7) % 200 for i in range(23)],
    [3 + (i * 13) % 250 for i in range(41)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Largest logprob by which a token chosen by int8 on two ranks may trail one process's best.
MAX_INT8_GAP = 0.1


def _llm(folder: str, tp: int, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(num_kv_blocks=64, max_num_batched_tokens=16,
                                      quantization="none")
    options.update(kwargs)
    return LLM(folder, tensor_parallel_size=tp, **options)  # type: ignore[arg-type]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY,
            prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _workers(llm: LLM) -> list:
    executor = llm.engine.core.executor
    assert executor is not None
    return executor.processes


def _wait_dead(procs: list, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in procs)


@pytest.fixture(scope="module")
def llama_tp1(llama_dir: str) -> LLM:
    return _llm(llama_dir, 1)


@pytest.fixture
def llama_tp2(llama_dir: str) -> Iterator[LLM]:
    """A process runs one tensor-parallel engine at a time: each test gets and closes one."""
    llm = _llm(llama_dir, 2)
    procs = _workers(llm)
    yield llm
    llm.close()
    assert _wait_dead(procs), "close() left a worker running"
    assert tp_size() == 1


# ------------------------------------------------------------------ sharded layers


def test_sharded_models_match_whole_models(llama_dir: str, qwen2_dir: str, qwen3_dir: str,
                                           llama_bias_dir: str) -> None:
    """Column/row-parallel projections (biases included), vocab-parallel embedding and head
    (tied or not, padded or not), on two ranks, give the whole model's logits; int8 after
    sharding stays within int8's error."""
    folders = [llama_dir, qwen2_dir, qwen3_dir, llama_bias_dir]
    jobs = [ShardJob(f) for f in folders] + [ShardJob(f, "int8") for f in (llama_dir, qwen3_dir)]
    out = run_sharded(jobs)
    full = [two_step_logits(load_ours(f)[0]) for f in folders]
    n = len(folders)
    for folder, ref, got in zip(folders, full, out[:n], strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=folder)
    for ref, got in zip((full[0], full[2]), out[n:n + 2], strict=True):
        rel = (got - ref).norm() / ref.norm()
        assert rel < 0.03, rel
    rows, logits = out[n + 2:]
    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(rows, weight)
    torch.testing.assert_close(logits, weight @ weight.T)


def test_int8_reference_is_meaningful(llama_dir: str) -> None:
    """The int8 bound above can fail: quantizing the whole model moves the logits too."""
    model = load_ours(llama_dir)[0]
    ref = two_step_logits(model)
    quantize_model(model, "int8")
    rel = (two_step_logits(model) - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.03


# ------------------------------------------------------------------ the engine


def test_greedy_tokens_match_one_process(llama_tp1: LLM, llama_tp2: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    params = [GREEDY, GREEDY, seeded]
    assert _tokens(llama_tp2, params) == _tokens(llama_tp1, params)


def test_random_sampling_keeps_ranks_in_step(llama_tp1: LLM, llama_tp2: LLM) -> None:
    """Unseeded sampling draws from each process's own RNG: the worker must continue from
    rank 0's tokens, or its KV cache (half the heads) would hold other tokens and the
    logprobs rank 0 reports would not be those of the text it returns."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llama_tp2.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        sampled = out.outputs[0].token_ids
        reported = [lp.logprob for lp in out.outputs[0].logprobs]
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        ref = llama_tp1.generate([prompt + sampled], score, use_tqdm=False)[0]
        expected = [lp.logprob for lp in ref.prompt_logprobs[len(prompt):]]
        assert reported == pytest.approx(expected, abs=1e-3)


def test_preemption_and_forks(llama_dir: str) -> None:
    """A KV cache too small for the batch preempts and recomputes; n=2 forks share prompt
    blocks and copy them on write: every rank follows the scheduler's blocks and copies."""
    prompts = [PROMPTS[2], [7 + (i * 3) % 200 for i in range(45)], PROMPTS[1]]
    params = [GREEDY, GREEDY,
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)]
    results, preemptions = [], []
    for tp in (1, 2):
        llm = _llm(llama_dir, tp, num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[c.token_ids for c in o.outputs] for o in outs])
        preemptions.append(llm.engine.core.stats().num_preemptions_total)
        llm.close()
    assert results[1] == results[0]
    assert preemptions[1] > 0


def test_one_tensor_parallel_engine_per_process(llama_tp2: LLM, llama_dir: str) -> None:
    with pytest.raises(RuntimeError, match="already runs a tensor-parallel engine"):
        _llm(llama_dir, 2)


def test_qwen3_greedy_tokens_and_close(qwen3_dir: str) -> None:
    """q/k norms and a tied vocab-parallel embedding as head; close() stops the worker."""
    expected = _tokens(_llm(qwen3_dir, 1))
    llm = _llm(qwen3_dir, 2)
    procs = _workers(llm)
    assert _tokens(llm) == expected
    llm.close()
    assert _wait_dead(procs)
    llm.close()  # idempotent


def test_int8_after_sharding(llama_dir: str) -> None:
    """int8 weight-only layers quantized from each rank's shard. Row-parallel layers get
    per-shard scales, so logits differ from one process's int8 by int8-sized amounts and a
    near-tie may flip (and the text after it follow): so each token two ranks chose must be
    one process's best or within a small logprob margin of it, scored on the same text."""
    one = _llm(llama_dir, 1, quantization="int8")
    llm = _llm(llama_dir, 2, quantization="int8")
    got = _tokens(llm)
    llm.close()
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    gaps = []
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ref = one.generate([prompt + tokens], score, use_tqdm=False)[0]
        for lp in ref.prompt_logprobs[len(prompt):]:
            gaps.append(max(lp.top.values()) - lp.logprob)
    assert max(gaps) < MAX_INT8_GAP, gaps
    assert sum(g == 0 for g in gaps) >= 0.9 * len(gaps), gaps


def test_ngram_speculation(llama_tp1: LLM, llama_dir: str) -> None:
    """Drafts proposed on rank 0 are verified by both ranks; greedy output is unchanged."""
    prompts = [[7, 8, 9, 10] * 6, PROMPTS[1]]
    expected = _tokens(llama_tp1, prompts=prompts)
    llm = _llm(llama_dir, 2, speculative="ngram", num_speculative_tokens=3)
    try:
        assert _tokens(llm, prompts=prompts) == expected
        assert llm.engine.core.spec_stats.num_draft_tokens > 0
    finally:
        llm.close()


def test_garbage_collection_stops_workers(llama_dir: str) -> None:
    llm = _llm(llama_dir, 2)
    procs = _workers(llm)
    del llm
    gc.collect()
    assert _wait_dead(procs)
    assert tp_size() == 1


def test_dead_worker_is_an_error(llama_dir: str) -> None:
    llm = _llm(llama_dir, 2)
    procs = _workers(llm)
    procs[0].kill()
    procs[0].join(10)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        _tokens(llm)
    llm.close()
    assert tp_size() == 1


@pytest.mark.slow
def test_gguf_model_on_three_ranks() -> None:
    """The embedded SmolLM2 GGUF (9 query / 3 KV heads, tied 49152-row vocabulary) on three
    CPU processes: dequantized q/k rows un-permuted, then sharded, give the same text; with
    quantization "auto" each rank quantizes its float shards to int4 instead of keeping the
    file's Q4 blocks (which are not cut to shards), and still answers sensibly."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    options: dict = dict(kv_cache_memory_bytes=64 << 20, max_model_len=512)
    one = LLM(dtype="float32", quantization="none", **options)
    expected = [o.outputs[0].text for o in one.generate(prompts, params)]
    del one
    options["tensor_parallel_size"] = 3
    tp3 = LLM(dtype="float32", quantization="none", **options)
    try:
        assert [o.outputs[0].text for o in tp3.generate(prompts, params)] == expected
    finally:
        tp3.close()
    tp3 = LLM(**options)
    try:
        assert tp3.engine.core.quantization == "int4"
        assert tp3.generate(prompts[0], params)[0].outputs[0].text.startswith(" Paris")
    finally:
        tp3.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_match_one(llama_dir: str) -> None:
    """NCCL between cuda:0 and cuda:1, control messages over gloo."""
    expected = _tokens(_llm(llama_dir, 1, device="cuda", dtype="float32"))
    llm = _llm(llama_dir, 2, device="cuda", dtype="float32")
    try:
        assert _tokens(llm) == expected
    finally:
        llm.close()


# ------------------------------------------------------------------ validation


def test_heads_not_divisible(llama_dir: str) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size"):
        _llm(llama_dir, 3)
    assert tp_size() == 1


def test_parallel_config_validation() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="timeout_s"):
        ParallelConfig(timeout_s=0)
    draft = EngineConfig(speculative=SpeculativeConfig(method="draft", draft_model="self:1"),
                         parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="speculative_model"):
        check_parallel_config(draft, torch.device("cpu"))


def test_more_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))
    check_parallel_config(config, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs GPUs cuda:1\.\.cuda:2"):
        check_parallel_config(config, torch.device("cuda", 1))


def test_cli_flag() -> None:
    for flag in ("-tp", "--tensor-parallel-size"):
        args = build_parser().parse_args(["generate", "hi", flag, "2"])
        assert engine_config_from_args(args).parallel.tensor_parallel_size == 2
    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args).parallel.tensor_parallel_size == 1
