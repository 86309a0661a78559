"""What the sampler needs to know about a step's rows, batched: `SamplingMetadata`.

Per step the runner builds one for the rows that need a next token. It holds tensors only for
the features some row uses (penalties, logit bias, min_tokens, top-k/top-p/min-p, seeds,
logprobs), so a batch of plain greedy or plain random requests pays for nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import host_tensor


@dataclass
class SamplingMetadata:
    """Batched sampling inputs for B rows. A feature's tensors are None when no row uses it."""

    # Every row is greedy (argmax) / every row samples; both False for a mixed batch.
    all_greedy: bool
    all_random: bool
    # [B] bool, True where the row is greedy. None when all_greedy or all_random.
    greedy_mask: torch.Tensor | None
    # [B] float; 1.0 on greedy rows so dividing is harmless. None when all_greedy.
    temperature: torch.Tensor | None
    # [B] long, 0 where the row has no top-k. None when no random row uses top-k.
    top_k: torch.Tensor | None
    # The largest top-k of the batch, known on the host so torch.topk needs no device sync.
    max_top_k: int
    # [B] float, 1.0 where unused. None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [B] float, 0.0 where unused. None when no random row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> that request's own generator, for random rows with a seed.
    generators: dict[int, torch.Generator]
    # True when no row has presence, frequency or repetition penalties.
    no_penalties: bool
    # [B] float each; set when not no_penalties.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [B, L] long output tokens, right-padded with -1 (empty rows for rows without penalties).
    output_tokens: torch.Tensor | None
    # [B, L] long prompt tokens padded with -1; only when some row has a repetition penalty.
    prompt_tokens: torch.Tensor | None
    # (rows, token ids, biases) as flat tensors, for logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, token ids) to set to -inf because the row has not reached min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Largest `logprobs` any row asked for; None when no row asked.
    max_num_logprobs: int | None
    # Structured outputs: ([B, ceil(V / 32)] int32 bitmask of the allowed tokens, the rows it
    # constrains). None when no row has a grammar.
    allowed_tokens: tuple[torch.Tensor, list[int]] | None = None
    # (rows, token ids): the one token each of these rows must write (a spent thinking
    # budget, see runner/thinking.py). None when no row is forced.
    forced_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
              output_token_ids: Sequence[Sequence[int]],
              generators: Sequence[torch.Generator | None],
              stop_token_ids: Sequence[Sequence[int]],
              device: torch.device | str = "cpu",
              allowed_tokens: tuple[torch.Tensor, list[int]] | None = None,
              forced_tokens: dict[int, int] | None = None,
              ) -> SamplingMetadata:
        """Batch the per-row inputs. ``stop_token_ids[i]`` are the ids ``min_tokens`` must
        suppress for row i (eos ids unless ignore_eos, plus the request's stop_token_ids);
        ``allowed_tokens`` is the structured outputs' bitmask (see the field);
        ``forced_tokens`` maps a row to the one token it must write."""
        n = len(params)
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = host_tensor(greedy, torch.bool, device)

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        gens: dict[int, torch.Generator] = {}
        if not all_greedy:
            # Greedy rows get neutral values so batched ops leave them alone.
            rand = [p for p, g in zip(params, greedy, strict=True) if not g]
            temperature = _column([1.0 if g else p.temperature
                                   for p, g in zip(params, greedy, strict=True)], device)
            max_top_k = max(p.top_k for p in rand)
            if max_top_k > 0:
                top_k = _column([0 if g else p.top_k for p, g in zip(params, greedy, strict=True)],
                                device, torch.long)
            if any(p.top_p < 1.0 for p in rand):
                top_p = _column([1.0 if g else p.top_p
                                 for p, g in zip(params, greedy, strict=True)], device)
            if any(p.min_p > 0.0 for p in rand):
                min_p = _column([0.0 if g else p.min_p
                                 for p, g in zip(params, greedy, strict=True)], device)
            gens = {i: gen for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
                    if gen is not None and not g}

        penalties = _build_penalties(params, prompt_token_ids, output_token_ids, device)
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        return cls(
            all_greedy=all_greedy, all_random=all_random, greedy_mask=greedy_mask,
            temperature=temperature, top_k=top_k, max_top_k=max_top_k, top_p=top_p, min_p=min_p, generators=gens,
            no_penalties=penalties is None,
            presence_penalties=None if penalties is None else penalties[0],
            frequency_penalties=None if penalties is None else penalties[1],
            repetition_penalties=None if penalties is None else penalties[2],
            output_tokens=None if penalties is None else penalties[3],
            prompt_tokens=None if penalties is None else penalties[4],
            logit_bias=_build_logit_bias(params, device),
            min_tokens_mask=_build_min_tokens(params, output_token_ids, stop_token_ids, n, device),
            max_num_logprobs=max_lp,
            allowed_tokens=allowed_tokens,
            forced_tokens=_build_forced(forced_tokens, device),
        )


_Penalties = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _column(values: list[float] | list[int], device: torch.device | str,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return host_tensor(values, dtype, device)


def _pad(rows: list[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [-1] * (width - len(r)) for r in rows]
    return host_tensor(padded, torch.long, device).view(len(rows), width)


def _build_penalties(params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                     output_ids: Sequence[Sequence[int]],
                     device: torch.device | str) -> _Penalties | None:
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    rep = [p.repetition_penalty for p in params]
    used = [a != 0.0 or b != 0.0 or c != 1.0 for a, b, c in zip(pres, freq, rep, strict=True)]
    if not any(used):
        return None
    # Rows without penalties contribute empty token lists: their tokens are never needed.
    outputs = _pad([o if u else () for o, u in zip(output_ids, used, strict=True)], device)
    prompts = None
    if any(r != 1.0 for r in rep):
        prompts = _pad([pr if r != 1.0 else () for pr, r in zip(prompt_ids, rep, strict=True)], device)
    return _column(pres, device), _column(freq, device), _column(rep, device), outputs, prompts


def _build_logit_bias(params: Sequence[SamplingParams], device: torch.device | str,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            ids.extend(p.logit_bias.keys())
            vals.extend(p.logit_bias.values())
    if not rows:
        return None
    return (host_tensor(rows, torch.long, device),
            host_tensor(ids, torch.long, device),
            host_tensor(vals, torch.float32, device))


def _build_min_tokens(params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                      stop_ids: Sequence[Sequence[int]], n: int,
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    for i in range(n):
        if params[i].min_tokens > len(output_ids[i]) and stop_ids[i]:
            rows.extend([i] * len(stop_ids[i]))
            ids.extend(stop_ids[i])
    if not rows:
        return None
    return (host_tensor(rows, torch.long, device),
            host_tensor(ids, torch.long, device))


def _build_forced(forced: dict[int, int] | None, device: torch.device | str,
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not forced:
        return None
    rows = sorted(forced)
    return (host_tensor(rows, torch.long, device),
            host_tensor([forced[r] for r in rows], torch.long, device))
