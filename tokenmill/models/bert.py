"""BERT (and its small relatives, e.g. MiniLM): a bidirectional encoder for embeddings.

Word + absolute position + token-type embeddings and a LayerNorm, then post-LN layers of
self-attention and a GELU MLP. The batch is flat: the step's sequences back to back with no
padding, each attending to all of its own tokens and to nothing else (one attention call per
group of equal-length sequences, sorted together). There is no KV cache: a sequence is computed whole in one
step. Query, key and value are one fused matmul. On CPUs that multiply bf16 natively the
projections can run in bf16 around an fp32 model (:meth:`BertModel.use_bf16_matmuls`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.config import ArchConfig
from tokenmill.models.layers import Bf16MatmulLinear, Embedding, Linear
from tokenmill.models.parallel import check_all_loaded

# Checkpoint names inside one layer -> (our module, row block of the fused qkv or None).
_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("inter", None),
    "output.dense": ("out", None),
    "output.LayerNorm": ("out_norm", None),
}
# Checkpoint tensors that embeddings do not use: BERT's [CLS] pooler (sentence-transformers
# pools the token states itself) and a cached position-id range.
_UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")
# Under use_bf16_matmuls, the dtype each projection gives: fp32 where the residual stream or the
# attention takes it, bf16 into the GELU (whose output is the next bf16 matmul's input). Putting
# the attention in bf16 too was ~6% faster and moved the worst parity sentence from 0.99993 to
# 0.99992 (all-MiniLM-L6-v2 against sentence-transformers in fp32, 2,313 sentences).
_BF16_MATMUL_OUTPUTS = {"qkv": torch.float32, "attn_out": torch.float32, "inter": torch.bfloat16,
                        "out": torch.float32}
# Task heads of BertFor* checkpoints (masked LM, next sentence), beside the "bert." encoder.
_HEAD_PREFIXES = ("cls.",)


def _hf_leaf(name: str) -> str:
    """TF-era checkpoints call LayerNorm parameters gamma / beta."""
    if name.endswith(".gamma"):
        return name.removesuffix(".gamma") + ".weight"
    if name.endswith(".beta"):
        return name.removesuffix(".beta") + ".bias"
    return name


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: ``param``, or its rows ``[start, start + rows)``."""

    param: nn.Parameter
    start: int | None = None
    rows: int = 0


class BertEmbeddings(nn.Module):
    """Token, position and token-type embeddings, summed and normalised."""

    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = Embedding(max(c.type_vocab_size, 1), c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        # Without token_types every token is of type 0: one text per sequence, as
        # sentence-transformers encodes it.
        types = (self.token_type_embeddings.weight[0] if token_types is None
                 else self.token_type_embeddings(token_types))
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + types
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """Self-attention and a GELU MLP, each followed by residual add and LayerNorm (post-LN)."""

    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.qkv = Linear(h, 3 * self.num_heads * self.head_dim)
        self.attn_out = Linear(self.num_heads * self.head_dim, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.inter = Linear(h, c.intermediate_size)
        self.out = Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
        ctx = encoder_attention(self.qkv(x), groups, self.num_heads, self.head_dim)
        x = self.attn_norm(x + self.attn_out(ctx))
        return self.out_norm(x + self.out(F.gelu(self.inter(x))))


def length_order(seq_lens: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The sequences of a flat batch sorted by length: their order (indices into
    ``seq_lens``), and the groups of equal length in that order as ``(length, first row,
    count)``, each group's rows contiguous."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[tuple[int, int, int]] = []
    row = 0
    for i in order:
        n = seq_lens[i]
        if groups and groups[-1][0] == n:
            groups[-1] = (n, groups[-1][1], groups[-1][2] + 1)
        else:
            groups.append((n, row, 1))
        row += n
    return order, groups


def encoder_attention(qkv: torch.Tensor, groups: list[tuple[int, int, int]],
                      num_heads: int, head_dim: int) -> torch.Tensor:
    """``[T, heads * head_dim]`` bidirectional attention of each sequence over itself, for
    rows laid out in ``groups`` of equal-length sequences (see :func:`length_order`).

    A group of B sequences of n tokens is one SDPA call ``[B, heads, n, d]`` on views of
    ``qkv``: a step costs one call per distinct length, not per sequence, no token is padded
    and nothing is gathered or scattered.
    """
    t = qkv.shape[0]
    out = qkv.new_empty(t, num_heads * head_dim)
    for n, row, count in groups:
        rows = slice(row, row + n * count)
        q, k, v = qkv[rows].view(count, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v)  # [B, heads, n, d]
        out[rows].view(count, n, num_heads, head_dim).copy_(ctx.transpose(1, 2))
    return out


class BertModel(nn.Module):
    """The BERT encoder over a flat batch: ``forward`` gives every token's final state.

    ``attn_meta`` supplies the sequence boundaries only (``query_lens_cpu``); its KV cache
    fields are unused. Parameters start uninitialized: fill them with :meth:`load_weights`.
    """

    is_encoder = True
    _unused = _UNUSED

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """``[T, hidden]`` final token states of the step's sequences.

        The rows are sorted by sequence length on the way in (integer ids, a cheap gather)
        and put back on the way out, so that every layer's attention works on contiguous
        groups of equal-length sequences."""
        lens = attn_meta.query_lens_cpu
        order, groups = length_order(lens)
        permuted = order != sorted(order)
        if permuted:
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in order])
            rows = rows.to(input_ids.device)
            input_ids, positions = input_ids[rows], positions[rows]
        x = self.embeddings(input_ids, positions, self.token_types(input_ids, positions))
        for layer in self.layers:
            x = layer(x, groups)
        if permuted:
            x = torch.empty_like(x).index_copy_(0, rows, x)
        return x

    def token_types(self, input_ids: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor | None:
        """Each token's segment; None: all of type 0 (one text a sequence)."""
        return None

    def use_bf16_matmuls(self) -> None:
        """Run every layer's four projections in bf16 (:class:`Bf16MatmulLinear`), keeping
        the embeddings, residuals, LayerNorms and attention in fp32 (the GELU takes and gives
        bf16: its output is rounded to bf16 for the next matmul anyway). Call after the
        weights are loaded, on an fp32 model."""
        for layer in self.layers:
            for name, out_dtype in _BF16_MATMUL_OUTPUTS.items():
                module = getattr(layer, name)
                if not isinstance(module, Bf16MatmulLinear):
                    setattr(layer, name, Bf16MatmulLinear(module, out_dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors (bare BertModel names, or "bert."-prefixed ones beside
        a task head) into the parameters; ValueError naming a tensor that is unexpected, of
        the wrong shape, or missing once ``weights`` is exhausted."""
        targets = self._hf_targets()
        loaded: set[str] = set()
        with torch.no_grad():
            for raw_name, tensor in weights:
                if raw_name.startswith(_HEAD_PREFIXES):
                    continue
                name = _hf_leaf(raw_name.removeprefix("bert."))
                if name in self._unused:
                    continue
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"unexpected tensor {raw_name!r} in checkpoint for "
                                     f"{self.config.architecture}")
                dst = (target.param if target.start is None
                       else target.param.narrow(0, target.start, target.rows))
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ValueError(f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if name in loaded:
                    raise ValueError(f"tensor {raw_name!r} appears twice in the checkpoint")
                dst.copy_(tensor)
                loaded.add(name)
        check_all_loaded(targets, loaded)

    def _hf_targets(self) -> dict[str, _Target]:
        """HF tensor name (without "bert.") -> where it goes."""
        targets = {f"embeddings.{n}": _Target(p)
                   for n, p in self.embeddings.named_parameters()}
        width = self.config.num_attention_heads * self.config.head_dim
        for i, layer in enumerate(self.layers):
            for hf_module, (ours, block) in _LAYER_NAMES.items():
                module = getattr(layer, ours)
                for leaf in ("weight", "bias"):
                    param = getattr(module, leaf)
                    name = f"encoder.layer.{i}.{hf_module}.{leaf}"
                    targets[name] = (_Target(param) if block is None
                                     else _Target(param, block * width, width))
        return targets


def pair_token_types(input_ids: torch.Tensor, positions: torch.Tensor,
                     sep_token_id: int) -> torch.Tensor:
    """Token types of a flat batch of pair encodings (``[CLS] a [SEP] b [SEP]``): 0 up to and
    including each sequence's first ``sep_token_id``, 1 after it, as BERT's tokenizers type a
    pair. Sequences are contiguous and their positions start at 0."""
    is_sep = (input_ids == sep_token_id).to(torch.int64)
    before = torch.cumsum(is_sep, 0) - is_sep  # separators before each row, whole batch
    starts = torch.nonzero(positions == 0).flatten()
    seq = torch.cumsum((positions == 0).to(torch.int64), 0) - 1
    return (before - before[starts][seq] > 0).to(torch.int64)


class BertForSequenceClassification(BertModel):
    """A cross-encoder (reranker): BERT over a pair of texts read together, its [CLS] state
    through BERT's pooler (dense, tanh) and a one-label classifier, whose sigmoid is the
    pair's score. Token types come from the ids: the second text starts after the first
    [SEP] (``sep_token_id``, set by the loader from the tokenizer). The engine pools the
    [CLS] state and calls :meth:`score_head` on it."""

    # The pooler is this head's first layer here.
    _unused = ("embeddings.position_ids",)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.pooler = Linear(h, h)
        self.classifier = Linear(h, config.num_labels)
        self.sep_token_id: int | None = None
        self.requires_grad_(False)

    def token_types(self, input_ids: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor | None:
        if self.sep_token_id is None:
            raise RuntimeError("a cross-encoder needs its tokenizer's [SEP] id (sep_token_id)")
        return pair_token_types(input_ids, positions, self.sep_token_id)

    def score_head(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``[N, 1]`` scores in (0, 1) of ``[N, hidden]`` [CLS] states, in fp32."""
        x = cls_states.to(self.pooler.weight.dtype)
        return torch.sigmoid(self.classifier(torch.tanh(self.pooler(x))).float())

    def _hf_targets(self) -> dict[str, _Target]:
        targets = super()._hf_targets()
        for hf, ours in (("pooler.dense", self.pooler), ("classifier", self.classifier)):
            targets[f"{hf}.weight"] = _Target(ours.weight)
            targets[f"{hf}.bias"] = _Target(ours.bias)
        return targets
