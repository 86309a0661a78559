"""Causal attention of variable-length prefill chunks (and any other step that is not decode
only) over the paged KV cache (the layout is :mod:`triton_kernels`'s)."""

from __future__ import annotations

from collections.abc import Sequence

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
    queries_to,
    row_align,
    sinks_arg,
    softmax_step,
    softmax_step_windowed,
    span,
    span_bases,
    span_rows,
    widens_to_fp16,
    window_arg,
)
from tokenmill.kernels.triton.pdl import launch_options, pdl_start
from tokenmill.utils import host_tensor

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
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, table_ptr, query_start_ptr,
                    seq_lens_ptr, tile_seq_ptr, tile_idx_ptr, qk_scale, sinks_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_co, stride_ch,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, FP16: tl.constexpr, CHUNK: tl.constexpr,
                    CHUNK_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr, WINDOW: tl.constexpr = 0,
                    SINKS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (tile, kv head): causal attention of BLOCK_M // GROUP query tokens of one
    sequence; the step's tiles are listed in ``tile_seq`` / ``tile_idx`` (sequence, tile of it),
    so a mixed step launches no programs for the empty tiles of its short sequences.

    The tile's rows are (token, query head) pairs over the GROUP heads of one KV head, so each
    K/V tile is loaded once for the whole group. The queries are the last ``query_len``
    positions of the sequence; keys are read from the cache up to the tile's last position,
    CHUNK of them at a time: a chunk's block ids (at most CHUNK_SPAN) are read once, and the
    loop over its tiles loads only K and V, which the pipeliner keeps in flight.

    With WINDOW > 0 (a sliding-window layer) the query at position p sees keys p - WINDOW + 1
    .. p only: the loop starts at the tile holding the first key of the tile's first query.
    With SINKS, ``sinks_ptr`` holds a base-2 logit per query head added to the softmax's
    denominator (attention sinks).
    """
    pdl_start(PDL)
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
    q = queries_to(tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                            + d[None, :], mask=mask, other=0.0), FP16)
    q_pos = ctx + tok
    # Every row sees key 0, so the first tile gives each row a finite max (no inf - inf);
    # under a window a row may see none of a tile's keys: softmax_step_windowed then.
    end = tl.minimum(seq_len, ctx + (q_tile + 1) * BLOCK_Q)
    lo = ctx * 0  # the first key any row of the tile sees
    if WINDOW > 0:
        lo = tl.maximum(ctx + q_tile * BLOCK_Q - WINDOW + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = table_ptr + b * stride_bt
    for c0 in range(lo // CHUNK * CHUNK, end, CHUNK):
        c_end = tl.minimum(c0 + CHUNK, end)
        first, bases = span_bases(table, c0, c_end, kv_head, stride_cb, stride_ch,
                                   BLOCK_SIZE, CHUNK_SPAN)
        for n0 in range(tl.maximum(c0, lo // BLOCK_N * BLOCK_N), c_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            row = span_rows(bases, first, pos, stride_co, BLOCK_SIZE, ROW_ALIGN)
            k, v = load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D,
                                 q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                keep = keep & (pos[None, :] > q_pos[:, None] - WINDOW)
                s = tl.where(keep, s, float("-inf"))
                m, denom, acc = softmax_step_windowed(s, v, m, denom, acc, DOT_PRECISION)
            else:
                s = tl.where(keep, s, float("-inf"))
                m, denom, acc = softmax_step(s, v, m, denom, acc, DOT_PRECISION)

    if SINKS:
        m, denom, acc = fold_sink(tl.load(sinks_ptr + heads), m, denom, acc)
    out = acc / denom[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


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
                      tiles: torch.Tensor | None = None,
                      window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
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
        window: a sliding-window layer's window in tokens (None: full attention).
        sinks: ``[Hq]`` a logit per query head added to each softmax's denominator
            (attention sinks); None: none.

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
    check_last_dim(q=q, kv_cache=kv_cache, out=out)
    group = num_heads // num_kv_heads
    if tiles is None:
        tiles = prefill_tiles(query_lens, num_heads, num_kv_heads, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    # A chunk holds whole tiles (both are powers of two), so no tile reaches past its span.
    chunk = max(_PREFILL_CHUNK, _PREFILL_BLOCK_N)
    _prefill_kernel[(tiles.shape[1], num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tiles[0], tiles[1],
        scale * LOG2E, sinks_arg(sinks, LOG2E, seq_lens), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0), *cache_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=prefill_block_m(num_heads, num_kv_heads), BLOCK_N=_PREFILL_BLOCK_N,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=dot_precision(q), FP16=widens_to_fp16(q, kv_cache),
        CHUNK=chunk, CHUNK_SPAN=span(chunk, k_cache.shape[1]),
        ROW_ALIGN=row_align(cache_strides), WINDOW=window_arg(window),
        SINKS=sinks is not None, num_warps=NUM_WARPS,
        **launch_options(q.device))
    return out
