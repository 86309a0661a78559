"""CUDA graphs for decode-only steps: one graph per batch size of a ladder, replayed with padding.

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels whose launch
costs more than their work. Capturing the whole forward pass once per batch size and replaying
it launches them all in one go. A graph replays fixed addresses and shapes, so:

- inputs live in persistent buffers, sized for the largest batch, that each step copies into;
- a step of ``n`` sequences runs the graph of the smallest captured size ``>= n``; the padding
  rows write their K/V to slot -1 (skipped by the store kernel) and have a context of 0 tokens
  (the attention kernels produce zeros for them), and their outputs are dropped;
- the attention metadata seen at capture promises the longest context a replay may have
  (``max_seq_len_bound``), so the decode kernel's launch grid covers every context, and the
  kernel reads the real lengths from the ``seq_lens`` buffer on the device;
- where the attention backend's launch for a batch size depends on the longest context (its
  context classes: short contexts want many short partitions, long ones long partitions), a
  graph is captured per class and a step replays the class of its longest context.

The capture itself is behind :class:`GraphCapture` so that the padding and buffer logic can be
tested on the CPU, where :class:`EagerReplay` stands in for a graph by re-running the captured
function over the same buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# Longest context a captured graph serves (vLLM's default too): the decode kernel's scratch
# grows with the promised context, and longer ones are rare enough to run eagerly.
MAX_CAPTURED_SEQ_LEN = 8192


def capture_sizes(max_batch_size: int) -> list[int]:
    """The ladder of batch sizes to capture, vLLM's: 1, 2, 4, then every multiple of 8 up to
    ``max_batch_size`` (which is always included). Padding wastes at most 7 rows."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += range(8, max_batch_size + 1, 8)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class GraphCapture:
    """How a function is recorded and replayed: a real CUDA graph here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None  # one memory pool shared by every graph, as they never run at once

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``fn``; returns (replay, the output tensor the replays write into)."""
        # Warm up outside the graph: first calls allocate workspaces and pick kernels.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class EagerReplay(GraphCapture):
    """Runs the captured function again on each replay: the CPU stand-in for tests."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()

        def replay() -> None:
            out.copy_(fn())

        return replay, out


@dataclass
class _Buffers:
    """Persistent inputs of every graph; a batch of ``bs`` uses the first ``bs`` rows."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64, -1 for padding
    seq_lens: torch.Tensor  # [max_bs] int32, 0 for padding
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, 0, 1, 2, ... (one token each)
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32


class DecodeGraphs:
    """Captured decode steps of ``model`` and the buffers they read.

    Build it after the KV cache is allocated (graphs hold the cache's addresses), then call
    :meth:`capture` once; :meth:`run` serves decode-only steps that :meth:`supports`.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend,
                 kv_caches: list[torch.Tensor], block_size: int, max_batch_size: int,
                 max_model_len: int, device: torch.device,
                 capturer: GraphCapture | None = None) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        # The longest context a replay may have; longer decode steps run eagerly.
        self.max_seq_len = min(max_model_len, MAX_CAPTURED_SEQ_LEN)
        self.device = device
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_blocks = -(-self.max_seq_len // block_size)
        self.capturer = capturer if capturer is not None else GraphCapture(device)
        n = self.max_batch_size
        self.buffers = _Buffers(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device),
        )
        # batch size -> its graphs by context class, ascending (the last for any context):
        # (the class's longest context or None, replay, hidden-state output [bs, hidden])
        self.graphs: dict[int, list[tuple[int | None, Callable[[], None], torch.Tensor]]] = {}

    def _metadata(self, bs: int, launch_context: int | None) -> AttentionMetadata:
        """Metadata over the first ``bs`` buffer rows, promising the longest context, whose
        decode launch is the one for contexts of at most ``launch_context`` tokens."""
        b = self.buffers
        meta = AttentionMetadata(
            backend=self.backend,
            kv_caches=self.kv_caches,
            slot_mapping=b.slot_mapping[:bs],
            query_start_loc=b.query_start_loc[:bs + 1],
            seq_lens=b.seq_lens[:bs],
            block_tables=b.block_tables[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_seq_len] * bs,
            block_size=self.block_size,
        )
        meta.max_seq_len_bound = self.max_seq_len
        meta.launch_context = launch_context
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per batch size and context class, the largest batch first (later
        ones reuse its memory)."""
        b = self.buffers
        for bs in reversed(self.sizes):
            classes = [c for c in self.backend.decode_context_classes(bs, self.kv_caches[0])
                       if c is None or c < self.max_seq_len]
            self.graphs[bs] = []
            for context in classes:
                meta = self._metadata(bs, context)

                def step(bs: int = bs, meta: AttentionMetadata = meta) -> torch.Tensor:
                    return self.model(b.input_ids[:bs], b.positions[:bs], meta)

                self.graphs[bs].append((context, *self.capturer.capture(step)))
        multi = {bs: [c for c, *_ in g] for bs, g in self.graphs.items() if len(g) > 1}
        logger.info("captured decode graphs for batch sizes %s%s", self.sizes,
                    f" (by longest context: {multi})" if multi else "")

    def supports(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits the buffers."""
        return (bool(self.graphs) and meta.decode_only and num_tokens == meta.num_seqs
                and num_tokens <= self.max_batch_size
                and meta.block_tables.shape[1] <= self.max_blocks
                and meta.max_seq_len <= self.max_seq_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a supported step, from the smallest graph that fits."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        b = self.buffers
        b.input_ids[:n].copy_(input_ids, non_blocking=True)
        b.positions[:n].copy_(positions, non_blocking=True)
        b.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        b.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        b.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if bs > n:
            # Padding rows: no K/V write, an empty context. Rows past a sequence's own
            # blocks are never read (the kernels stop at seq_len), so they need no clearing.
            b.slot_mapping[n:bs].fill_(-1)
            b.seq_lens[n:bs].fill_(0)
            b.input_ids[n:bs].fill_(0)
            b.positions[n:bs].fill_(0)
        longest = meta.max_seq_len
        replay, out = next((replay, out) for context, replay, out in self.graphs[bs]
                           if context is None or longest <= context)
        replay()
        return out[:n]
