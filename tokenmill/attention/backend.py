"""Paged attention backends: write the step's K/V into the cache, then attend over each context.

``TorchAttentionBackend`` is plain PyTorch: the CPU path, and the reference that faster device
backends (Triton on CUDA) are tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Computes causal attention of a flat batch of new tokens over a paged KV cache."""

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store ``k``/``v`` at ``meta.slot_mapping`` and attend ``q`` over each sequence's context.

        Args:
            q: ``[T, Hq, D]`` queries of all scheduled tokens, sequences back to back.
            k: ``[T, Hkv, D]`` keys of the same tokens (``Hq`` is a multiple of ``Hkv``).
            v: ``[T, Hkv, D]`` values of the same tokens.
            kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` this layer's cache, updated in place;
                its dtype may be narrower than ``q``'s (the CPU's fp16 cache).
            meta: the step's batch layout.
            scale: softmax scale, usually ``D ** -0.5``.
            window: a sliding-window layer's window (None: full attention): the query at
                position ``p`` sees the keys at positions ``p - window + 1 .. p`` only
                (transformers' ``sliding_window``; Gemma 3's local layers).
            sinks: ``[Hq]`` a logit per query head added to each softmax's denominator and
                attending to nothing (gpt-oss's attention sinks); None: none.

        Returns:
            ``[T, Hq * D]`` attention output in the dtype of ``q``.
        """

    # Whether forward_rotary() takes q and k before the rotary embedding and rotates them in
    # the kernel that stores the step's K/V (one kernel a layer fewer than rotating first).
    fuses_rotary = False

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       cos: torch.Tensor, sin: torch.Tensor,
                       window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` of ``q`` and ``k`` not yet rotated: ``cos`` and ``sin`` are the
        step's ``[T, 1, D]`` tables (``RotaryEmbedding.cos_sin``'s). ``q`` is rotated in place
        and ``k`` goes to the cache rotated; ``k`` itself may be left as it was. Only where
        :attr:`fuses_rotary` is set."""
        raise NotImplementedError(f"the {self.name} attention backend does not rotate q and k")

    def decode_context_classes(self, batch: int, kv_cache: torch.Tensor) -> tuple[int | None, ...]:
        """The longest-context bounds (ascending, then None: any) at which this backend's
        decode launch for ``batch`` sequences over ``kv_cache`` changes: a CUDA-graph runner
        captures one graph per class (``AttentionMetadata.launch_context``)."""
        return (None,)


@dataclass
class _DecodePlan:
    """Sequences that add one token this step, attended together in one padded batch."""

    # Rows of q that belong to these sequences; None when they are all rows, in order.
    rows: torch.Tensor | None
    # [num_seqs * blocks_per_seq] block ids, so one index_select gathers every context.
    blocks: torch.Tensor
    num_seqs: int
    blocks_per_seq: int
    # Longest context; gathered rows past it are dropped before attention.
    ctx_len: int
    # [num_seqs, 1, 1, ctx_len] True where a key is padding past its sequence's end; None when
    # every sequence has ctx_len tokens.
    pad_mask: torch.Tensor | None


@dataclass
class _PrefillSeq:
    """One sequence that adds several tokens this step, attended on its own."""

    start: int  # first row in q
    end: int  # one past its last row
    seq_len: int
    index: int  # the sequence's row in the block tables
    # Block ids holding its context; None when the chunk is the whole context, so the new k/v
    # can be attended directly without reading them back from the cache.
    blocks: torch.Tensor | None
    # [query_len, seq_len] causal mask for a chunk that starts after position 0.
    mask: torch.Tensor | None


@dataclass
class _StepPlan:
    """Everything about a step's layout that is the same for every layer."""

    num_tokens: int
    decode: _DecodePlan | None
    prefill: list[_PrefillSeq]
    # (start, length, context, block-table row) of each prefill chunk, flat: the argument of
    # the CPU backend's kernel, made on its first layer's call.
    prefill_chunks: list[int] | None = None
    # The sliding window this plan masks to (None: full attention), and the plans of the
    # step's other windows, made on the first call of a layer with that window.
    window: int | None = None
    windowed: dict[int, _StepPlan] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    """Pure PyTorch paged attention built on ``scaled_dot_product_attention``.

    Decode tokens of all sequences go through one block gather and one masked attention; prefill
    chunks are attended one sequence at a time. The plan of the step (gather indices, masks) is
    built on the first layer's call and cached on the metadata for the other layers.
    """

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        plan = _step_plan(meta, num_tokens, q.device, window)
        if kv_cache.dtype != k.dtype:
            # Stored narrower than computed: attend over the stored values everywhere, the new
            # tokens' too, so a token's keys read the same whether cached or just computed.
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        # Write first, so chunks that continue a context read their own keys from the cache.
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if num_tokens == 0:
            return q.new_empty(0, num_heads * head_dim)

        decode = plan.decode
        if decode is not None and decode.rows is None:
            return _decode(q, kv_cache, decode, scale, sinks)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if decode is not None:
            assert decode.rows is not None
            out.index_copy_(0, decode.rows, _decode(q.index_select(0, decode.rows), kv_cache,
                                                    decode, scale, sinks))
        self._prefill(q, k, v, kv_cache, meta, plan, scale, out, sinks)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, plan: _StepPlan, scale: float,
                 out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        """Write the attention of the step's prefill chunks into their rows of ``out``
        (``[T, Hq * D]``), one chunk at a time through SDPA (with ``sinks``, through the
        plain product, softmax and product)."""
        num_heads, head_dim = q.shape[1:]
        for seq in plan.prefill:
            o = _prefill_one(q, k, v, kv_cache, seq, scale, sinks)
            out[seq.start:seq.end].view(seq.end - seq.start, num_heads, head_dim).copy_(o)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` with ``sinks`` (broadcast to ``scores[..., :1]``)
    one more logit of each row's denominator, whose share is dropped (None: plain softmax)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan,
            scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attend one query per sequence over its gathered context: ``[B, Hq, D] -> [B, Hq*D]``."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    padded = plan.blocks_per_seq * block_size
    k = kv_cache[0].index_select(0, plan.blocks).view(num_seqs, padded, num_kv_heads, head_dim)
    v = kv_cache[1].index_select(0, plan.blocks).view(num_seqs, padded, num_kv_heads, head_dim)
    k = k[:, :plan.ctx_len].to(q.dtype).transpose(1, 2)
    v = v[:, :plan.ctx_len].to(q.dtype).transpose(1, 2)
    # Query heads that share a KV head become that head's "query rows", so GQA needs no copy of
    # K/V: [B, Hkv, group, D] against [B, Hkv, L, D].
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # Plain matmul-softmax-matmul: with a handful of query rows per head, SDPA's CPU flash
    # kernel costs several times more than these three ops.
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)
    if plan.pad_mask is not None:
        scores.masked_fill_(plan.pad_mask, float("-inf"))
    group_sinks = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
    out = torch.matmul(softmax_with_sinks(scores, group_sinks), v)
    return out.reshape(num_seqs, num_heads * head_dim)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 seq: _PrefillSeq, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attend one sequence's chunk of queries: returns ``[query_len, Hq, D]`` (a view)."""
    qs = q[seq.start:seq.end].transpose(0, 1)
    if seq.blocks is None:
        ks = k[seq.start:seq.end].transpose(0, 1)
        vs = v[seq.start:seq.end].transpose(0, 1)
    else:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        ks = kv_cache[0].index_select(0, seq.blocks).view(-1, num_kv_heads, head_dim)
        vs = kv_cache[1].index_select(0, seq.blocks).view(-1, num_kv_heads, head_dim)
        ks = ks[:seq.seq_len].transpose(0, 1)
        vs = vs[:seq.seq_len].transpose(0, 1)
    ks, vs = ks.to(q.dtype), vs.to(q.dtype)  # no-ops unless the cache is narrower
    if sinks is not None:  # SDPA has no extra logit in the denominator
        return _attend_with_sinks(qs, ks, vs, seq.mask, scale, sinks).transpose(0, 1)
    # A batch dimension of 1: SDPA's CPU flash kernel takes only 4-D inputs, and 3-D ones fall
    # back to the math path (materialized scores, about 3x slower on a 500-token prompt).
    out = F.scaled_dot_product_attention(
        qs[None], ks[None], vs[None], attn_mask=seq.mask, is_causal=seq.mask is None,
        scale=scale, enable_gqa=qs.shape[0] != ks.shape[0])
    return out[0].transpose(0, 1)


def _attend_with_sinks(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                       mask: torch.Tensor | None, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``qs`` ``[Hq, Lq, D]`` over ``ks``/``vs`` ``[Hkv, Lk, D]`` (the
    queries the last ``Lq`` positions; ``mask`` ``[Lq, Lk]`` True where a key is seen, None:
    plain causal) with each head's sink in the softmax's denominator: ``[Hq, Lq, D]``."""
    num_heads, query_len, head_dim = qs.shape
    num_kv_heads, key_len = ks.shape[:2]
    if mask is None:
        mask = torch.ones(query_len, key_len, dtype=torch.bool, device=qs.device).tril(
            key_len - query_len)
    qg = qs.view(num_kv_heads, num_heads // num_kv_heads, query_len, head_dim)
    scores = torch.matmul(qg, ks[:, None].transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, sinks.view(num_kv_heads, -1, 1, 1))
    return torch.matmul(probs, vs[:, None]).view(num_heads, query_len, head_dim)


def _step_plan(meta: AttentionMetadata, num_tokens: int, device: torch.device,
               window: int | None) -> _StepPlan:
    """The step's plan for layers of ``window`` (None: full attention), made on the first
    layer that asks for it and kept on ``meta`` for the others."""
    plan = meta.backend_plan
    if not isinstance(plan, _StepPlan):
        plan = _build_plan(meta, num_tokens, device)
        meta.backend_plan = plan
    if window is None:
        return plan
    if window <= 0:
        raise ValueError(f"sliding window must be a positive number of tokens, got {window}")
    if window not in plan.windowed:
        plan.windowed[window] = _build_plan(meta, num_tokens, device, window)
    return plan.windowed[window]


def _build_plan(meta: AttentionMetadata, num_tokens: int, device: torch.device,
                window: int | None = None) -> _StepPlan:
    """Plan the step from the host-side lengths (no device sync); with ``window``, its masks
    also hide the keys that fell out of each query's window."""
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens_cpu sums to {sum(query_lens)} but q has {num_tokens} rows")
    bs = meta.block_size
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    decode: _DecodePlan | None = None
    if decode_seqs:
        decode = _plan_decode(meta, decode_seqs, device, window)
    prefill: list[_PrefillSeq] = []
    start = 0
    for i, (qlen, slen) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if qlen > slen:
            raise ValueError(f"sequence {i}: query_len {qlen} > seq_len {slen}")
        if qlen > 1:
            blocks = mask = None
            if qlen < slen:
                nblk = -(-slen // bs)
                blocks = meta.block_tables[i, :nblk].long()
            # A window shorter than the context hides keys: no plain causal mask then.
            if qlen < slen or (window is not None and window < slen):
                cols = torch.arange(slen, device=device)
                rows = torch.arange(slen - qlen, slen, device=device)
                mask = cols[None, :] <= rows[:, None]
                if window is not None:
                    mask &= cols[None, :] > rows[:, None] - window
            prefill.append(_PrefillSeq(start, start + qlen, slen, i, blocks, mask))
        start += qlen
    return _StepPlan(num_tokens, decode, prefill, window=window)


def _plan_decode(meta: AttentionMetadata, seqs: list[int], device: torch.device,
                 window: int | None = None) -> _DecodePlan:
    bs = meta.block_size
    lens = [meta.seq_lens_cpu[i] for i in seqs]
    ctx_len = max(lens)
    nblk = -(-ctx_len // bs)
    all_seqs = len(seqs) == meta.num_seqs
    if all_seqs:
        tables = meta.block_tables[:, :nblk]
        seq_lens = meta.seq_lens
        rows = None
    else:
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        tables = meta.block_tables.index_select(0, idx)[:, :nblk]
        seq_lens = meta.seq_lens.index_select(0, idx)
        starts = meta.query_start_loc.index_select(0, idx)
        rows = starts.long()
    if window is not None and ctx_len > window + bs:
        return _plan_decode_window(tables, seq_lens, lens, rows, bs, window, device)
    mask = None
    cols = torch.arange(ctx_len, device=device)[None, :]
    if min(lens) != ctx_len:
        mask = cols >= seq_lens[:, None]
    if window is not None and ctx_len > window:
        # The query is at position seq_len - 1: it sees keys from seq_len - window on.
        early = cols < seq_lens[:, None] - window
        mask = early if mask is None else mask | early
    if mask is not None:
        mask = mask.view(len(seqs), 1, 1, ctx_len)
    blocks = tables.reshape(-1).long()
    return _DecodePlan(rows, blocks, len(seqs), nblk, ctx_len, mask)


def _plan_decode_window(tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                        rows: torch.Tensor | None, bs: int, window: int,
                        device: torch.device) -> _DecodePlan:
    """A sliding-window layer's decode over contexts longer than the window: each sequence
    gathers only the blocks from the one holding its window's first key, so a step reads
    about ``window`` keys a sequence, not its whole context."""
    first = [max(0, n - window) // bs for n in lens]  # each sequence's first block
    nblk = max(-(-n // bs) - f for n, f in zip(lens, first, strict=True))
    start = torch.tensor(first, dtype=torch.long, device=device)[:, None]
    idx = (start + torch.arange(nblk, device=device)[None, :]).clamp_(max=tables.shape[1] - 1)
    blocks = tables.gather(1, idx).reshape(-1).long()
    # Gathered key j of a sequence is at position first * bs + j.
    pos = start * bs + torch.arange(nblk * bs, device=device)[None, :]
    mask = (pos >= seq_lens[:, None]) | (pos < seq_lens[:, None] - window)
    ctx_len = nblk * bs
    return _DecodePlan(rows, blocks, len(lens), nblk, ctx_len,
                       mask.view(len(lens), 1, 1, ctx_len))
