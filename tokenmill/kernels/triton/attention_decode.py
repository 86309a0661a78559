"""Flash decoding over the paged KV cache: one query per sequence, its context cut into
partitions attended in parallel, then combined (the layout is :mod:`triton_kernels`'s).

The launch depends only on shapes and a bound on the contexts, so a decode step can be captured
in a CUDA graph; its settings per GPU and batch size come from
:mod:`tokenmill.kernels.tuning.decode_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.attention import (
    LOG2E,
    MIN_DOT,
    check_last_dim,
    dot_precision,
    fold_sink,
    load_kv_rows,
    load_kv_tile,
    queries_to,
    row_align,
    sinks_arg,
    softmax_step,
    span,
    span_bases,
    span_rows,
    widens_to_fp16,
    window_arg,
)
from tokenmill.kernels.triton.pdl import launch_options, pdl_start
from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr,
                         part_out_ptr, part_lse_ptr, out_ptr, qk_scale, sinks_ptr,
                         stride_qb, stride_qh, stride_bt, stride_cb, stride_co, stride_ch,
                         stride_ob, stride_oh,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FP16: tl.constexpr,
                         TABLE_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr,
                         DIRECT: tl.constexpr, WINDOW: tl.constexpr = 0,
                         SINKS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (seq, kv head, split): the GROUP query heads of one KV head over one partition.

    Writes the partition's normalized output and log2-sum-exp per query head, to be combined by
    ``_decode_reduce_kernel``. A partition that starts at or past the sequence's end does nothing.
    With DIRECT (one partition covers every context) it writes the attention output itself to
    ``out_ptr`` instead, zeros for a sequence of length 0, and no reduction follows.

    With TABLE_SPAN > 0 (the launch's ``preload_table``) the partition's block ids, at most
    TABLE_SPAN of them, are read before the loop and each tile's rows are gathered from them;
    ROW_ALIGN is what every cache row's element offset is a multiple of (the strides').

    With WINDOW > 0 (a sliding-window layer) the query sees the last WINDOW keys only: a
    partition that ends before them writes nothing (the reduction starts after it), and the
    one they start in begins at the tile holding the first.

    With SINKS, ``sinks_ptr`` holds a base-2 logit per query head added to the softmax's
    denominator: by the output itself with DIRECT, else by the reduction.
    """
    pdl_start(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * PARTITION
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    out_offs = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if start >= seq_len:
        if DIRECT:  # a padding row: its output is read (and ignored) like any other
            tl.store(out_ptr + out_offs,
                     tl.zeros([BLOCK_G, BLOCK_D], out_ptr.dtype.element_ty), mask=out_mask)
        return
    end = tl.minimum(start + PARTITION, seq_len)
    first_n = start
    lo = seq_len * 0  # the first key in the window
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
        if end <= lo:
            return
        first_n = tl.maximum(start, lo // BLOCK_N * BLOCK_N)
    q = queries_to(tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                            mask=g_mask[:, None] & d_mask[None, :], other=0.0), FP16)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table = table_ptr + b * stride_bt
    if TABLE_SPAN > 0:  # the partition's block ids, read once
        first, bases = span_bases(table, start, end, kv_head, stride_cb, stride_ch,
                                   BLOCK_SIZE, TABLE_SPAN)
    for n0 in range(first_n, end, BLOCK_N):
        if TABLE_SPAN > 0:
            # Tiles never cross the partition's end (BLOCK_N divides PARTITION), so every
            # position is in the span; past ``end`` it picks a masked id.
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            row = span_rows(bases, first, pos, stride_co, BLOCK_SIZE, ROW_ALIGN)
            k, v = load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D,
                                 q.dtype)
        else:
            k, v, pos, valid = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n0, end, kv_head,
                                             stride_cb, stride_co, stride_ch,
                                             HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if WINDOW > 0:  # every tile holds a key of the window (it starts at first_n)
            valid = valid & (pos >= lo)
        s = tl.where(valid[None, :], s, float("-inf"))
        m, denom, acc = softmax_step(s, v, m, denom, acc, DOT_PRECISION)

    if DIRECT:
        if SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0)
            m, denom, acc = fold_sink(sink, m, denom, acc)
        tl.store(out_ptr + out_offs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        # Scratch is [B, Hq, num_splits, D] and [B, Hq, num_splits], contiguous.
        row = (b * NUM_HEADS + heads) * num_splits + split
        tl.store(part_lse_ptr + row, m + tl.math.log2(denom), mask=g_mask)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / denom[:, None],
                 mask=out_mask)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, num_splits,
                          stride_ob, stride_oh, sinks_ptr,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          PARTITION: tl.constexpr, BLOCK_D: tl.constexpr,
                          WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    """Program (seq, query head): combine the partitions that hold keys, weighted by their sums.

    Only the first ``cdiv(seq_len, PARTITION)`` partitions are read, since the others were never
    written; a sequence of length 0 (a padding row) gets zeros. Under a WINDOW the partitions
    before the window's first key were not written either: the loop starts after them.
    """
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    used = (seq_len + PARTITION - 1) // PARTITION
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row0 = (b * NUM_HEADS + h) * num_splits
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    total = tl.full([BLOCK_D], 0.0, tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0) // PARTITION
    for split in range(first, used):
        # The split's lse, broadcast over D so that the running values stay one shape.
        lse = tl.load(part_lse_ptr + row0 + split + d * 0)
        part = tl.load(part_out_ptr + (row0 + split) * HEAD_DIM + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new
    if SINKS:  # one more term of the denominator, attending to nothing
        sink = tl.load(sinks_ptr + h + d * 0)
        m_new = tl.maximum(m, sink)
        alpha = tl.math.exp2(m - m_new)
        acc = acc * alpha
        total = total * alpha + tl.math.exp2(sink - m_new)
    # total >= 1 whenever a partition was read (the largest lse has weight 1), and acc is 0
    # when none was: dividing by max(total, 1) is exact in the first case and 0 in the second.
    out = acc / tl.maximum(total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                     out: torch.Tensor | None = None,
                     partition_size: int = DEFAULT_LAUNCH.partition_size,
                     block_n: int = DEFAULT_LAUNCH.block_n,
                     num_warps: int = DEFAULT_LAUNCH.num_warps,
                     num_stages: int | None = DEFAULT_LAUNCH.num_stages,
                     fp8_compute: str = DEFAULT_LAUNCH.fp8_compute,
                     max_registers: int | None = DEFAULT_LAUNCH.max_registers,
                     preload_table: bool = DEFAULT_LAUNCH.preload_table,
                     window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attend one query per sequence over its paged context (flash decoding).

    Each sequence's context is cut into partitions of ``partition_size`` tokens, attended in
    parallel and then combined; when one partition covers ``max_seq_len``, the partition's
    kernel writes the output and nothing is combined. The launch depends only on tensor
    shapes, ``max_seq_len`` and ``partition_size``, never on the values in ``seq_lens``, so it
    can be captured in a CUDA graph: pass a fixed bound (the graph's max model length, or the
    longest context of its class) as ``max_seq_len``. Rows whose ``seq_len`` is 0 (batch
    padding) get zeros.

    Args:
        q: ``[B, Hq, D]`` the query of each sequence.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` the layer's cache.
        block_tables: ``[B, max_blocks]`` int32 block ids of each sequence.
        seq_lens: ``[B]`` int32 context lengths, each at most ``max_seq_len``.
        scale: softmax scale.
        max_seq_len: bound on ``seq_lens`` that sizes the grid of partitions.
        out: optional ``[B, Hq, D]`` output (any strides with a contiguous last dimension).
        partition_size: tokens per partition, a power of two of at least 16.
        block_n, num_warps, num_stages: the split kernel's keys per tile (a power of two of at
            least 16), warps per program and software-pipelining depth (None: Triton's
            default); benchmarks/gpu/attention_bw.py sweeps them.
        fp8_compute: what an fp8 cache is widened to (:func:`widens_to_fp16`).
        max_registers: the split kernel's registers a thread (Triton's ``maxnreg``; None:
            the compiler's choice).
        preload_table: read each partition's block ids once, before the loop over its tiles,
            so that the tiles' loads can be pipelined (``num_stages``); otherwise each tile
            reads its own.
        window: a sliding-window layer's window in tokens (None: full attention): the
            query sees the last ``window`` keys of its context only.
        sinks: ``[Hq]`` a logit per query head added to each softmax's denominator
            (attention sinks); None: none.

    Returns:
        ``out`` or a new ``[B, Hq, D]`` tensor in the dtype of q.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if partition_size < MIN_DOT or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= {MIN_DOT}, "
                         f"got {partition_size}")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows but q has {num_seqs}")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    check_last_dim(q=q, kv_cache=kv_cache, out=out)
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    # One partition holds every context: the split kernel writes the output itself.
    direct = num_splits == 1
    # (Unused then: one element each, as an empty tensor may have no address to pass.)
    part_out = torch.empty(1 if direct else num_seqs * num_heads * num_splits * head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(1 if direct else num_seqs * num_heads * num_splits,
                           dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    block_size = k_cache.shape[1]
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    sinks_l2 = sinks_arg(sinks, LOG2E, part_lse)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out, scale * LOG2E,
        sinks_l2,
        q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PARTITION=partition_size, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=min(block_n, partition_size), BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q), FP16=widens_to_fp16(q, kv_cache, fp8_compute),
        TABLE_SPAN=span(partition_size, block_size) if preload_table else 0,
        ROW_ALIGN=row_align(cache_strides), DIRECT=direct, WINDOW=window_arg(window),
        SINKS=sinks is not None, num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
        **({} if max_registers is None else {"maxnreg": max_registers}),
        **launch_options(q.device))
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, out, num_splits, out.stride(0), out.stride(1),
            sinks_l2, NUM_HEADS=num_heads, HEAD_DIM=head_dim, PARTITION=partition_size,
            BLOCK_D=block_d, WINDOW=window_arg(window), SINKS=sinks is not None,
            **launch_options(part_out.device))
    return out
