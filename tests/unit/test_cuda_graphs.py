"""Decode CUDA graphs' padding and persistent buffers, checked on the CPU.

A real capture needs a GPU (tests/gpu has that test); here :class:`EagerReplay` stands in for the
graph, re-running the captured function over the same persistent buffers, with the Triton
backend in Triton's interpreter. What is tested is everything but the capture: the batch-size
ladder, copying each step into the buffers, padding rows that must not write the KV cache nor
disturb real rows, and the engine choosing graphs for decode steps only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.runner.cuda_graphs import DecodeGraphs, EagerReplay, capture_sizes  # noqa: E402


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def _tiny_llm(**kwargs: object) -> LLM:
    return LLM(model="tiny-llama", load_format="dummy", num_kv_blocks=64, max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8, **kwargs)


def _with_graphs(llm: LLM, max_batch_size: int) -> DecodeGraphs:
    """Switch the engine to the Triton backend and stand-in graphs, as EngineCore does on
    CUDA."""
    runner = llm.engine.core.executor.runner
    runner.backend = TritonAttentionBackend(decode_partition_size=32)
    runner.cpu_program = None
    runner.capture_decode_graphs(max_batch_size, llm.engine.core.max_model_len,
                                 capturer=EagerReplay())
    assert runner.decode_graphs is not None
    return runner.decode_graphs


def test_padded_graph_replays_match_eager_decoding() -> None:
    """Batches of 3 and 5 sequences replay the graphs of 4 and 8 (padded); greedy tokens equal
    those of the eager torch backend, so padding rows neither wrote into other sequences' KV
    nor changed their outputs."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31] * 19, [41, 42], [51] * 40]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = _tiny_llm().generate([{"prompt_token_ids": p} for p in prompts], params)

    llm = _tiny_llm()
    graphs = _with_graphs(llm, max_batch_size=8)
    assert graphs.sizes == [1, 2, 4, 8]
    replays = _count_replays(graphs)
    for group in (prompts[:3], prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params)
        want = eager[:len(group)]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert (4, None) in replays and (8, None) in replays  # 3 and 5 sequences, padded


def _count_replays(graphs: DecodeGraphs) -> list[tuple[int, int | None]]:
    """Wrap every graph's replay so that it logs (batch size, context class) when it runs."""
    replays: list[tuple[int, int | None]] = []
    for bs, by_context in graphs.graphs.items():
        for i, (context, replay, out) in enumerate(by_context):
            def counted(replay=replay, key=(bs, context)) -> None:
                replays.append(key)
                replay()
            by_context[i] = (context, counted, out)
    return replays


def test_a_graph_per_context_class_where_the_launch_depends_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuning whose launch changes with the longest context gets a graph per class; each
    step replays the class of its longest context, which launches what an eager step of that
    context would, and the tokens equal eager decoding's."""
    from tokenmill.attention import triton_backend
    from tokenmill.kernels.tuning.decode_attention import parse_tuning

    tuning = parse_tuning({"by_batch": [
        {"max_batch": 1, "partition_size": 64},
        {"max_context": 24, "partition_size": 16, "block_n": 16, "num_warps": 4},
        {"max_context": 40, "partition_size": 32, "block_n": 16},
        {"partition_size": 64, "block_n": 32}]}, "test")
    prompts = [[11, 12, 13], [21] * 7, [31] * 30]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    eager = _tiny_llm().generate([{"prompt_token_ids": p} for p in prompts], params)

    llm = _tiny_llm()
    runner = llm.engine.core.executor.runner
    runner.backend = TritonAttentionBackend(decode_tuning=tuning)
    runner.cpu_program = None
    runner.capture_decode_graphs(4, llm.engine.core.max_model_len, capturer=EagerReplay())
    graphs = runner.decode_graphs
    assert graphs is not None
    assert {bs: [c for c, *_ in g] for bs, g in graphs.graphs.items()} == {
        1: [None], 2: [24, 40, None], 4: [24, 40, None]}
    replays = _count_replays(graphs)
    launches: list[int] = []
    bounds: dict[int, set[int]] = {}
    real = triton_backend.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(kwargs["partition_size"])
        bounds.setdefault(kwargs["partition_size"], set()).add(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    for group in (prompts[:2], prompts):
        del launches[:]
        start = len(replays)
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params)
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in eager[:len(group)]]
        # Classes in ascending order as the contexts grow: the first group stays within 24
        # tokens (prompts of 3 and 7 plus 14), the second goes from 31 to 44.
        used = [c for _, c in replays[start:]]
        assert used == sorted(used, key=lambda c: c or 10**9), used
        # Every replay re-ran the model (EagerReplay): its layers launched the class's setting.
        want = {24: 16, 40: 32, None: 64}
        assert set(launches) == {want[c] for c in used}
    assert {c for _, c in replays} == {24, 40, None}
    # A class's graph sizes its grid for the class's longest context, the last for the
    # graphs' own bound.
    assert bounds == {16: {24}, 32: {40}, 64: {graphs.max_seq_len}}


def test_steps_graphs_cannot_serve_run_eagerly() -> None:
    llm = _tiny_llm()
    graphs = _with_graphs(llm, max_batch_size=2)
    runner = llm.engine.core.executor.runner
    from tokenmill.runner.flat_batch import FlatBatch

    batch = FlatBatch(16)
    batch.add([1, 2, 3], 0, [1])  # a prefill: never from a graph
    _, _, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    assert not graphs.supports(3, meta)
    batch = FlatBatch(16)
    for i in range(3):  # three decodes: more than the largest graph
        batch.add([5], 4, [2 + i])
    _, _, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    assert not graphs.supports(3, meta)
    batch = FlatBatch(16)
    batch.add([5], 4, [2])
    _, _, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    assert graphs.supports(1, meta)
    # More sequences than any graph: the engine still answers, eagerly.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [7, i + 1]} for i in range(4)], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_padding_rows_do_not_touch_the_kv_cache() -> None:
    llm = _tiny_llm()
    graphs = _with_graphs(llm, max_batch_size=8)
    runner = llm.engine.core.executor.runner
    before = [c.clone() for c in runner.kv_caches]
    from tokenmill.runner.flat_batch import FlatBatch

    batch = FlatBatch(16)
    for token, block in ((9, 3), (8, 4), (7, 5)):  # three first tokens, in blocks 3, 4, 5
        batch.add([token], 0, [block])
    ids, pos, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    with torch.inference_mode():
        graphs.run(ids, pos, meta)  # 3 rows -> the graph of 4
    for old, new in zip(before, runner.kv_caches, strict=True):
        changed = (old != new).flatten(2).any(-1)  # [2, blocks]
        assert set(changed.nonzero()[:, 1].tolist()) == {3, 4, 5}
    assert graphs.buffers.slot_mapping[3].item() == -1
    assert graphs.buffers.seq_lens[3].item() == 0


def test_max_captured_context_is_capped() -> None:
    from tokenmill.runner import cuda_graphs

    llm = _tiny_llm()
    runner = llm.engine.core.executor.runner
    graphs = DecodeGraphs(runner.model, TritonAttentionBackend(), runner.kv_caches, 16, 4,
                          100_000, torch.device("cpu"), EagerReplay())
    assert graphs.max_seq_len == cuda_graphs.MAX_CAPTURED_SEQ_LEN
    assert graphs.buffers.block_tables.shape == (4, cuda_graphs.MAX_CAPTURED_SEQ_LEN // 16)


def test_the_last_graph_launches_the_rule_for_the_graphs_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule for contexts up to the graphs' own bound (the max model length) makes no class
    of its own, since no longer context replays: the one graph launches it (its metadata
    promises that longest context), with a grid sized for the bound (one partition of it
    here, so no reduction)."""
    from tokenmill.attention import triton_backend
    from tokenmill.kernels.tuning.decode_attention import parse_tuning

    tuning = parse_tuning({"by_batch": [
        {"max_context": 256, "partition_size": 256, "block_n": 32},
        {"partition_size": 32, "block_n": 16}]}, "test")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13], [21] * 7]
    eager = _tiny_llm().generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = _tiny_llm()  # max_model_len 256
    runner = llm.engine.core.executor.runner
    runner.backend = TritonAttentionBackend(decode_tuning=tuning)
    runner.cpu_program = None
    runner.capture_decode_graphs(2, llm.engine.core.max_model_len, capturer=EagerReplay())
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.max_seq_len == 256
    assert {bs: [c for c, *_ in g] for bs, g in graphs.graphs.items()} == {1: [None], 2: [None]}
    replays = _count_replays(graphs)
    launches: list[tuple[int, int]] = []
    real = triton_backend.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append((kwargs["partition_size"], args[5]))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert replays and set(launches) == {(256, 256)}
