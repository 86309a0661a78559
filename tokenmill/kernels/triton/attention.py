"""Paged attention in Triton: the cache layout, the K/V store, and the pieces that the decode
(:mod:`tokenmill.kernels.triton.attention_decode`) and prefill (:mod:`tokenmill.kernels.triton.attention_prefill`)
kernels share.

The layer cache is ``[2, num_blocks, block_size, Hkv, D]`` (keys, then values); token ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``. The
attention kernels gather block ids per key tile (or per run of tiles, read once), so tiles need
not align with cache blocks and any block size works. Softmax runs in fp32 with base-2
exponentials (the scale is folded into ``qk_scale = scale * log2(e)``); outputs are in the dtype
of q.

q/k/v may be strided views (slices of a fused projection) as long as the head dimension is
contiguous; the cache must be contiguous in its last dimension too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.pdl import launch_options, pdl_start
from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH

LOG2E = 1.4426950408889634
# An fp8 KV cache (``--kv-cache-dtype fp8``): e4m3, unscaled (a scale of 1, vLLM's default
# without calibrated scales); K and V beyond +-448 are clamped when stored.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = tl.constexpr(448.0)
FP16_MAX = tl.constexpr(65504.0)
# tl.dot needs every dimension >= 16 on GPUs: decode pads its query heads and the head dim up
# to it, and decode partitions are at least this long.
MIN_DOT = 16
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_co, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr,
                     PDL: tl.constexpr = False):
    """One program per token: copy its K and V (all heads) to its cache slot, in the cache's
    dtype; with SATURATE (an fp8 cache) values beyond fp8's range are clamped to it."""
    pdl_start(PDL)
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
def rope_factors(cos_row, sin_row, d, mask, HALF: tl.constexpr):
    """A token's rotary factors at half-dims ``d``, in fp32, from its rows of
    ``RotaryEmbedding.cos_sin``'s tables: cos, and sin from the second half of the sign-folded
    table (its first half holds -sin)."""
    cos = tl.load(cos_row + d, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotated_halves(x, mask, cos, sin, HALF: tl.constexpr):
    """The two halves of the heads at ``x`` (pointers to their first halves) rotated
    (rotate-half layout) in fp32, rounded to x's dtype: ``x1 cos - x2 sin``,
    ``x2 cos + x1 sin``."""
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x.dtype.element_ty
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            cos_ptr, sin_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_cb, stride_co, stride_ch, stride_ct, stride_st,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, SATURATE: tl.constexpr,
                            PDL: tl.constexpr = False):
    """One program per token: rotate its queries in place (rotate-half layout, by the token's
    cos and sign-folded sin rows, ``RotaryEmbedding.cos_sin``'s), and write its keys rotated
    and its values to its cache slot. ``k`` itself is left as it was.

    The rotated keys are rounded to k's dtype before the cache's, so the cache holds the same
    bytes as after a rotary kernel and ``_store_kv_kernel``."""
    pdl_start(PDL)
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    cos, sin = rope_factors(cos_ptr + t * stride_ct, sin_ptr + t * stride_st, d, d_mask, HALF)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (hq < NUM_Q_HEADS) & d_mask
    q = q_ptr + t * stride_qt + hq * stride_qh + d
    q1, q2 = rotated_halves(q, q_mask, cos, sin, HALF)
    tl.store(q, q1, mask=q_mask)
    tl.store(q + HALF, q2, mask=q_mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A negative slot is a padding row (CUDA graphs pad the batch with -1): write nothing.
    if slot < 0:
        return
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = (hk < NUM_KV_HEADS) & d_mask
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + hk * stride_ch + d
    k1, k2 = rotated_halves(k_ptr + t * stride_kt + hk * stride_kh + d, kv_mask, cos, sin,
                            HALF)
    tl.store(k_cache_ptr + dst, _to_cache(k1, k_cache_ptr, SATURATE), mask=kv_mask)
    tl.store(k_cache_ptr + dst + HALF, _to_cache(k2, k_cache_ptr, SATURATE), mask=kv_mask)
    v = v_ptr + t * stride_vt + hk * stride_vh + d
    for part in tl.static_range(2):
        x = tl.load(v + part * HALF, mask=kv_mask)
        tl.store(v_cache_ptr + dst + part * HALF, _to_cache(x, v_cache_ptr, SATURATE),
                 mask=kv_mask)


@triton.jit
def _to_cache(x, cache_ptr, SATURATE: tl.constexpr):
    """``x`` in the cache's dtype; clamped to +-FP8_MAX first when SATURATE (fp8 has no
    infinity: a value past its range would become NaN)."""
    if SATURATE:
        return tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX).to(
            cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, n0, end, kv_head,
                  stride_cb, stride_co, stride_ch,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr):
    """K and V ``[BLOCK_N, BLOCK_D]`` of positions ``n0 .. n0+BLOCK_N-1`` (zeros from ``end``),
    in dtype COMPUTE, their block ids read from the table."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    k, v = load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM, BLOCK_D, COMPUTE)
    return k, v, pos, valid


@triton.jit
def load_kv_rows(k_cache_ptr, v_cache_ptr, row, valid, HEAD_DIM: tl.constexpr,
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
def span_bases(table_ptr, start, end, kv_head, stride_cb, stride_ch,
                BLOCK_SIZE: tl.constexpr, SPAN: tl.constexpr):
    """``(first, bases)``: the block ids of positions ``start .. end-1`` (at most SPAN blocks
    from block ``first``), read once, as element offsets of the KV head in each block.

    A loop over the span's tiles then takes its cache addresses from these (``span_rows``)
    and does no load of its own but K and V, which Triton's pipeliner can keep in flight
    (num_stages - 1 tiles ahead). With a block-id load inside the loop it waits for every copy
    before each tile."""
    first = start // BLOCK_SIZE
    span = tl.arange(0, SPAN)
    ids = tl.load(table_ptr + first + span, mask=first + span <= (end - 1) // BLOCK_SIZE,
                  other=0)
    return first, ids.to(tl.int64) * stride_cb + kv_head * stride_ch


@triton.jit
def span_rows(bases, first, pos, stride_co, BLOCK_SIZE: tl.constexpr,
               ROW_ALIGN: tl.constexpr):
    """Element offsets of the cache rows of positions ``pos``, all within the span of
    ``bases`` (:func:`span_bases`); ROW_ALIGN is what every offset is a multiple of (the
    cache's strides are). Without that hint the gathered offsets have no known alignment, and
    the loads are neither vectorized nor pipelined."""
    row = tl.gather(bases, pos // BLOCK_SIZE - first, 0) + (pos % BLOCK_SIZE) * stride_co
    return tl.multiple_of(row, ROW_ALIGN)


@triton.jit
def queries_to(q, FP16: tl.constexpr):
    """The queries in the dtype of the dot products: fp16 for an fp8 cache widened to fp16
    (clamped to fp16's range first; bf16 queries of a real model lie far inside it)."""
    if FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)
    return q


@triton.jit
def softmax_step(s, v, m, denom, acc, DOT_PRECISION: tl.constexpr):
    """Fold a tile of base-2 scores ``s`` (-inf where masked) into the running max/sum/output."""
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, denom, acc


@triton.jit
def fold_sink(sink, m, denom, acc):
    """Fold one more base-2 logit per row, ``sink``, attending to nothing (an attention sink,
    learned per head) into the running max/sum/output: it adds to the denominator only."""
    m_new = tl.maximum(m, sink)
    alpha = tl.math.exp2(m - m_new)
    return m_new, denom * alpha + tl.math.exp2(sink - m_new), acc * alpha[:, None]


def sinks_arg(sinks: torch.Tensor | None, scale: float, fallback: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks operand: ``[Hq]`` fp32 logits in base 2 (as the scores are), or
    ``fallback`` (any tensor: its address goes unread) without sinks."""
    if sinks is None:
        return fallback
    return (sinks.float() * scale).contiguous()


@triton.jit
def softmax_step_windowed(s, v, m, denom, acc, DOT_PRECISION: tl.constexpr):
    """:func:`softmax_step` for tiles where a row may have no key yet (a sliding window's
    first tiles): such a row keeps its max at -inf and adds nothing, where the plain step
    would compute ``exp2(-inf - -inf)``, NaN."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, denom, acc


def window_arg(window: int | None) -> int:
    """A kernel's WINDOW: the sliding window in tokens, 0 for full attention; ValueError for
    a window that is not a positive number of tokens."""
    if window is None:
        return 0
    if window <= 0:
        raise ValueError(f"sliding window must be a positive number of tokens, got {window}")
    return int(window)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` ``[T]``.

    Slots below 0 are skipped, so padded rows of a captured CUDA graph write nothing.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_last_dim(k=k, v=v, kv_cache=kv_cache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE=kv_cache.dtype in FP8_CACHE_DTYPES, **launch_options(k.device))


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` in place and write ``k`` rotated and ``v`` (``[T, Hkv, D]``)
    into ``kv_cache`` at ``slot_mapping``: ``rotary_`` of q and k, then :func:`store_kv`, in one
    kernel. ``cos`` and ``sin`` are the step's ``[T, 1, D]`` tables (sin sign-folded, as
    ``RotaryEmbedding.cos_sin`` makes them). ``k`` is not changed; slots below 0 are skipped
    (q is rotated all the same)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}")
    check_last_dim(q=q, k=k, v=v, kv_cache=kv_cache, cos=cos, sin=sin)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        SATURATE=kv_cache.dtype in FP8_CACHE_DTYPES, **launch_options(q.device))


def span(length: int, block_size: int) -> int:
    """Block ids a run of ``length`` positions starting at a multiple of ``length`` can touch,
    rounded up to a power of two: cdiv(length, block size) when the block size divides the
    length (the run starts on a block), one more when it does not."""
    return triton.next_power_of_2(triton.cdiv(length, block_size)
                                  + (length % block_size != 0))


def row_align(cache_strides: Sequence[int]) -> int:
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


def dot_precision(q: torch.Tensor) -> str:
    """fp32 inputs get exact products: tl.dot would otherwise round them to tf32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def check_last_dim(**tensors: torch.Tensor) -> None:
    """The kernels index the head dimension with stride 1."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tuple(t.stride())}")
