"""Triton kernels for paged attention, and the Python functions that launch them.

The layer cache is ``[2, num_blocks, block_size, Hkv, D]`` (keys, then values); token ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``. Every
kernel gathers block ids per key tile, so tiles need not align with cache blocks and any block
size works. Softmax runs in fp32 with base-2 exponentials (the scale is folded into
``qk_scale = scale * log2(e)``); outputs are in the dtype of q.

q/k/v may be strided views (slices of a fused projection) as long as the head dimension is
contiguous; the cache must be contiguous in its last dimension too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tokenmill.attention.decode_tuning import DEFAULT_LAUNCH
from tokenmill.utils import host_tensor

_LOG2E = 1.4426950408889634
# An fp8 KV cache (``--kv-cache-dtype fp8``): e4m3, unscaled (a scale of 1, vLLM's default
# without calibrated scales); K and V beyond +-448 are clamped when stored.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = tl.constexpr(448.0)
FP16_MAX = tl.constexpr(65504.0)
# tl.dot needs every dimension >= 16 on GPUs: decode pads its query heads and the head dim up
# to it, and decode partitions are at least this long.
_MIN_DOT = 16
# Prefill tile sizes and warps, chosen from ptxas's register report for sm_90 at head dim 128
# (benchmarks/results/gpu/kernel-notes.md): the prefill tile of 64 x 32 needs 255 registers at
# 4 warps and 128 at 8. The decode kernel's launch settings are tuned per GPU model
# (decode_tuning.py, benchmarks/gpu/attention_bw.py).
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 32
NUM_WARPS = 8
# Keys of a prefill tile's context whose block ids are read at once (then its tiles' loads
# pipeline): at head dim 128 and Triton 3.6 the kernel keeps its registers (94) and two
# programs an SM, with two copies in flight at each wait instead of none
# (benchmarks/gpu/kernel_registers.py).
_PREFILL_CHUNK = 512


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_co, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr):
    """One program per token: copy its K and V (all heads) to its cache slot, in the cache's
    dtype; with SATURATE (an fp8 cache) values beyond fp8's range are clamped to it."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A negative slot is a padding row (CUDA graphs pad the batch with -1): write nothing.
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr, SATURATE), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr, SATURATE), mask=mask)


@triton.jit
def _to_cache(x, cache_ptr, SATURATE: tl.constexpr):
    """``x`` in the cache's dtype; clamped to +-FP8_MAX first when SATURATE (fp8 has no
    infinity: a value past its range would become NaN)."""
    if SATURATE:
        return tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX).to(
            cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, n0, end, kv_head,
                  stride_cb, stride_co, stride_ch,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr):
    """K and V ``[BLOCK_N, BLOCK_D]`` of positions ``n0 .. n0+BLOCK_N-1`` (zeros from ``end``),
    in dtype COMPUTE, their block ids read from the table."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    k, v = _load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D, COMPUTE)
    return k, v, pos, valid


@triton.jit
def _load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr):
    """K and V of the cache rows starting at element offsets ``row`` (zeros where not
    ``valid``), widened from an fp8 cache to COMPUTE."""
    d = tl.arange(0, BLOCK_D)
    offs = row[:, None] + d[None, :]
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    return k, v


@triton.jit
def _span_bases(table_ptr, start, end, kv_head, stride_cb, stride_ch,
                BLOCK_SIZE: tl.constexpr, SPAN: tl.constexpr):
    """``(first, bases)``: the block ids of positions ``start .. end-1`` (at most SPAN blocks
    from block ``first``), read once, as element offsets of the KV head in each block.

    A loop over the span's tiles then takes its cache addresses from these (``_span_rows``)
    and does no load of its own but K and V, which Triton's pipeliner can keep in flight
    (num_stages - 1 tiles ahead). With a block-id load inside the loop it waits for every copy
    before each tile."""
    first = start // BLOCK_SIZE
    span = tl.arange(0, SPAN)
    ids = tl.load(table_ptr + first + span, mask=first + span <= (end - 1) // BLOCK_SIZE,
                  other=0)
    return first, ids.to(tl.int64) * stride_cb + kv_head * stride_ch


@triton.jit
def _span_rows(bases, first, pos, stride_co, BLOCK_SIZE: tl.constexpr,
               ROW_ALIGN: tl.constexpr):
    """Element offsets of the cache rows of positions ``pos``, all within the span of
    ``bases`` (:func:`_span_bases`); ROW_ALIGN is what every offset is a multiple of (the
    cache's strides are). Without that hint the gathered offsets have no known alignment, and
    the loads are neither vectorized nor pipelined."""
    row = tl.gather(bases, pos // BLOCK_SIZE - first, 0) + (pos % BLOCK_SIZE) * stride_co
    return tl.multiple_of(row, ROW_ALIGN)


@triton.jit
def _queries_to(q, FP16: tl.constexpr):
    """The queries in the dtype of the dot products: fp16 for an fp8 cache widened to fp16
    (clamped to fp16's range first; bf16 queries of a real model lie far inside it)."""
    if FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)
    return q


@triton.jit
def _softmax_step(s, v, m, denom, acc, DOT_PRECISION: tl.constexpr):
    """Fold a tile of base-2 scores ``s`` (-inf where masked) into the running max/sum/output."""
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, denom, acc


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr,
                         part_out_ptr, part_lse_ptr, out_ptr, qk_scale,
                         stride_qb, stride_qh, stride_bt, stride_cb, stride_co, stride_ch,
                         stride_ob, stride_oh,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FP16: tl.constexpr,
                         TABLE_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr,
                         DIRECT: tl.constexpr):
    """Program (seq, kv head, split): the GROUP query heads of one KV head over one partition.

    Writes the partition's normalized output and log2-sum-exp per query head, to be combined by
    ``_decode_reduce_kernel``. A partition that starts at or past the sequence's end does nothing.
    With DIRECT (one partition covers every context) it writes the attention output itself to
    ``out_ptr`` instead, zeros for a sequence of length 0, and no reduction follows.

    With TABLE_SPAN > 0 (the launch's ``preload_table``) the partition's block ids, at most
    TABLE_SPAN of them, are read before the loop and each tile's rows are gathered from them;
    ROW_ALIGN is what every cache row's element offset is a multiple of (the strides').
    """
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
    q = _queries_to(tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                            mask=g_mask[:, None] & d_mask[None, :], other=0.0), FP16)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table = table_ptr + b * stride_bt
    if TABLE_SPAN > 0:  # the partition's block ids, read once
        first, bases = _span_bases(table, start, end, kv_head, stride_cb, stride_ch,
                                   BLOCK_SIZE, TABLE_SPAN)
    for n0 in range(start, end, BLOCK_N):
        if TABLE_SPAN > 0:
            # Tiles never cross the partition's end (BLOCK_N divides PARTITION), so every
            # position is in the span; past ``end`` it picks a masked id.
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            row = _span_rows(bases, first, pos, stride_co, BLOCK_SIZE, ROW_ALIGN)
            k, v = _load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D,
                                 q.dtype)
        else:
            k, v, pos, valid = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, n0, end, kv_head,
                                             stride_cb, stride_co, stride_ch,
                                             HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m, denom, acc = _softmax_step(s, v, m, denom, acc, DOT_PRECISION)

    if DIRECT:
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
                          stride_ob, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          PARTITION: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (seq, query head): combine the partitions that hold keys, weighted by their sums.

    Only the first ``cdiv(seq_len, PARTITION)`` partitions are read, since the others were never
    written; a sequence of length 0 (a padding row) gets zeros.
    """
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
    for split in range(0, used):
        # The split's lse, broadcast over D so that the running values stay one shape.
        lse = tl.load(part_lse_ptr + row0 + split + d * 0)
        part = tl.load(part_out_ptr + (row0 + split) * HEAD_DIM + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new
    # total >= 1 whenever a partition was read (the largest lse has weight 1), and acc is 0
    # when none was: dividing by max(total, 1) is exact in the first case and 0 in the second.
    out = acc / tl.maximum(total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, table_ptr, query_start_ptr,
                    seq_lens_ptr, tile_seq_ptr, tile_idx_ptr, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_co, stride_ch,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, FP16: tl.constexpr, CHUNK: tl.constexpr,
                    CHUNK_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Program (tile, kv head): causal attention of BLOCK_M // GROUP query tokens of one
    sequence; the step's tiles are listed in ``tile_seq`` / ``tile_idx`` (sequence, tile of it),
    so a mixed step launches no programs for the empty tiles of its short sequences.

    The tile's rows are (token, query head) pairs over the GROUP heads of one KV head, so each
    K/V tile is loaded once for the whole group. The queries are the last ``query_len``
    positions of the sequence; keys are read from the cache up to the tile's last position,
    CHUNK of them at a time: a chunk's block ids (at most CHUNK_SPAN) are read once, and the
    loop over its tiles loads only K and V, which the pipeliner keeps in flight.
    """
    tile = tl.program_id(0)
    b = tl.load(tile_seq_ptr + tile)
    q_tile = tl.load(tile_idx_ptr + tile)
    kv_head = tl.program_id(1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # position of the first query

    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]
    rows = (q_start + tok).to(tl.int64)
    q = _queries_to(tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                            + d[None, :], mask=mask, other=0.0), FP16)
    q_pos = ctx + tok
    # Every row sees key 0, so the first tile gives each row a finite max (no inf - inf).
    end = tl.minimum(seq_len, ctx + (q_tile + 1) * BLOCK_Q)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = table_ptr + b * stride_bt
    for c0 in range(0, end, CHUNK):
        c_end = tl.minimum(c0 + CHUNK, end)
        first, bases = _span_bases(table, c0, c_end, kv_head, stride_cb, stride_ch,
                                   BLOCK_SIZE, CHUNK_SPAN)
        for n0 in range(c0, c_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            row = _span_rows(bases, first, pos, stride_co, BLOCK_SIZE, ROW_ALIGN)
            k, v = _load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D,
                                 q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m, denom, acc = _softmax_step(s, v, m, denom, acc, DOT_PRECISION)

    out = acc / denom[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` ``[T]``.

    Slots below 0 are skipped, so padded rows of a captured CUDA graph write nothing.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_last_dim(k=k, v=v, kv_cache=kv_cache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE=kv_cache.dtype in FP8_CACHE_DTYPES)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                     out: torch.Tensor | None = None,
                     partition_size: int = DEFAULT_LAUNCH.partition_size,
                     block_n: int = DEFAULT_LAUNCH.block_n,
                     num_warps: int = DEFAULT_LAUNCH.num_warps,
                     num_stages: int | None = DEFAULT_LAUNCH.num_stages,
                     fp8_compute: str = DEFAULT_LAUNCH.fp8_compute,
                     max_registers: int | None = DEFAULT_LAUNCH.max_registers,
                     preload_table: bool = DEFAULT_LAUNCH.preload_table) -> torch.Tensor:
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

    Returns:
        ``out`` or a new ``[B, Hq, D]`` tensor in the dtype of q.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if partition_size < _MIN_DOT or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= {_MIN_DOT}, "
                         f"got {partition_size}")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows but q has {num_seqs}")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _check_last_dim(q=q, kv_cache=kv_cache, out=out)
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
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    block_size = k_cache.shape[1]
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out, scale * _LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PARTITION=partition_size, BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=min(block_n, partition_size), BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q), FP16=widens_to_fp16(q, kv_cache, fp8_compute),
        TABLE_SPAN=_span(partition_size, block_size) if preload_table else 0,
        ROW_ALIGN=_row_align(cache_strides), DIRECT=direct,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
        **({} if max_registers is None else {"maxnreg": max_registers}))
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, PARTITION=partition_size, BLOCK_D=block_d)
    return out


def prefill_block_m(num_heads: int, num_kv_heads: int) -> int:
    """Rows of a prefill tile: (token, query head) pairs, at least the whole GQA group."""
    return max(_PREFILL_BLOCK_M, triton.next_power_of_2(num_heads // num_kv_heads))


def prefill_tiles(query_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                  device: torch.device) -> torch.Tensor:
    """``[2, num_tiles]`` int32: each prefill program's sequence and query tile within it.

    Built on the host from the step's query lengths (no device sync) once per step; a
    sequence of ``n`` tokens gets ``cdiv(n, tokens per tile)`` tiles, a decode row one.
    """
    block_q = prefill_block_m(num_heads, num_kv_heads) // (num_heads // num_kv_heads)
    seqs: list[int] = []
    idx: list[int] = []
    for b, n in enumerate(query_lens):
        count = triton.cdiv(n, block_q)
        seqs.extend([b] * count)
        idx.extend(range(count))
    return host_tensor([seqs, idx], torch.int32, device)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      query_lens: Sequence[int], out: torch.Tensor | None = None,
                      tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a flat batch of variable-length chunks over their paged contexts.

    Sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]`` of q, the last
    positions of a context of ``seq_lens[b]`` tokens; all keys, including the chunk's own, are
    read from the cache, so call :func:`store_kv` first. Sequences of one token are fine.

    Args:
        q: ``[T, Hq, D]`` queries.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` the layer's cache.
        block_tables: ``[B, max_blocks]`` int32 block ids of each sequence.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths.
        seq_lens: ``[B]`` int32 context lengths.
        scale: softmax scale.
        query_lens: the ``B`` chunk lengths, on the host (they lay out the grid).
        out: optional ``[T, Hq, D]`` output (any strides with a contiguous last dimension).
        tiles: :func:`prefill_tiles` of ``query_lens``, when the caller keeps it for every layer.

    Returns:
        ``out`` or a new ``[T, Hq, D]`` tensor in the dtype of q.
    """
    num_heads, head_dim = q.shape[1:]
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or max(query_lens, default=0) == 0:
        return out
    _check_last_dim(q=q, kv_cache=kv_cache, out=out)
    group = num_heads // num_kv_heads
    if tiles is None:
        tiles = prefill_tiles(query_lens, num_heads, num_kv_heads, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    # A chunk holds whole tiles (both are powers of two), so no tile reaches past its span.
    chunk = max(_PREFILL_CHUNK, _PREFILL_BLOCK_N)
    _prefill_kernel[(tiles.shape[1], num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tiles[0], tiles[1],
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *cache_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=prefill_block_m(num_heads, num_kv_heads), BLOCK_N=_PREFILL_BLOCK_N,
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=_dot_precision(q), FP16=widens_to_fp16(q, kv_cache),
        CHUNK=chunk, CHUNK_SPAN=_span(chunk, k_cache.shape[1]),
        ROW_ALIGN=_row_align(cache_strides), num_warps=NUM_WARPS)
    return out


def _span(length: int, block_size: int) -> int:
    """Block ids a run of ``length`` positions starting at a multiple of ``length`` can touch,
    rounded up to a power of two: cdiv(length, block size) when the block size divides the
    length (the run starts on a block), one more when it does not."""
    return triton.next_power_of_2(triton.cdiv(length, block_size)
                                  + (length % block_size != 0))


def _row_align(cache_strides: Sequence[int]) -> int:
    """What every cache row's element offset is a multiple of, as the kernels' hint: 16 where
    the strides are (Triton then vectorizes and pipelines the loads), else 1."""
    return 16 if all(st % 16 == 0 for st in cache_strides) else 1


def widens_to_fp16(q: torch.Tensor, kv_cache: torch.Tensor,
                   fp8_compute: str = DEFAULT_LAUNCH.fp8_compute) -> bool:
    """Whether the kernels take the dot products of an fp8 cache in fp16 (``fp8_compute``
    "fp16", 16-bit queries) rather than in the queries' dtype ("query", or fp32 queries).

    Every e4m3 value is exact in fp16 and converts in one instruction per pair, where bf16
    takes a longer sequence; the softmax weights keep more bits in fp16 than in bf16. The
    cost is the queries' range: clamped to +-65,504 (bf16 reaches 3e38).
    """
    return (kv_cache.dtype in FP8_CACHE_DTYPES and fp8_compute == "fp16"
            and q.dtype in (torch.bfloat16, torch.float16))


def _dot_precision(q: torch.Tensor) -> str:
    """fp32 inputs get exact products: tl.dot would otherwise round them to tf32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _check_last_dim(**tensors: torch.Tensor) -> None:
    """The kernels index the head dimension with stride 1."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tuple(t.stride())}")
