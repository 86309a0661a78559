"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, with vLLM's names."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.engine.args import engine_config
from tokenmill.engine.classify import LabelScorer, run_label_scoring
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine.scoring import cross_encoder_prompts, pair_texts, scores_of
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationResult,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.sampling_params import BeamSearchParams, PoolingParams, SamplingParams
from tokenmill.tokenizer import Tokenizer

# generate() shows a progress bar (by default) from this many prompts on.
PROGRESS_BAR_MIN_PROMPTS = 10

Messages = list[dict]


class LLM:
    """An engine for offline generation over many prompts at once.

    The keywords are the engine's options, the command line's flags with underscores
    (``max_num_seqs=8`` is ``--max-num-seqs 8``; ``tokenmill generate --help`` lists them
    all with their defaults); each is one field of a ``tokenmill.config`` dataclass.
    ``model`` is a GGUF file or a Hugging Face folder; None runs the embedded
    SmolLM2-135M-Instruct; with ``load_format="dummy"`` it may name a preset architecture
    ("llama-3.1-8b", "qwen3-0.6b") with random weights. Memory for the KV cache is
    ``num_kv_blocks`` blocks, else ``kv_cache_memory_bytes``, else on CUDA what
    ``gpu_memory_utilization`` of the GPU leaves after weights and activations, else
    ``kv_cache_memory_fraction`` of free memory. On CUDA, decode steps replay CUDA graphs
    (``enforce_eager=True``: off) for batches up to ``cuda_graph_max_batch_size``.
    ``quantization`` "int8" / "int4" stores the weights quantized (weight-only), "fp8" in e4m3
    with activations quantized per token; "auto" keeps a GGUF file's own Q4 / Q8 weights
    compact on the CPU, "none" computes in float.
    ``speculative="ngram"`` (prompt lookup) or ``speculative_model`` (a model file with the same
    tokenizer, or "self:N": the first N layers of this one) turns on speculative decoding of
    ``num_speculative_tokens`` tokens per step; ``llm.engine.stats().spec_decoding`` counts them.
    ``tensor_parallel_size`` > 1 shards the model over that many processes (GPUs, or CPU
    processes); :meth:`close` stops them, as does dropping the LLM or leaving the interpreter.
    ``deterministic=True`` makes each request's tokens independent of its batch mates (CPU;
    see ``EngineConfig``).
    ``async_scheduling`` schedules and launches each step while the one before it still runs
    (None: on for one CUDA process without speculative decoding; see ``SchedulerConfig``).
    ``task="embed"`` makes an embedding engine (:meth:`embed`; the default for encoder models
    such as BERT, and with no ``model`` it runs the embedded all-MiniLM-L6-v2); ``pooling``
    ("cls", "mean", "max", "last") overrides how its token states are pooled.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        # The keywords are the engine's options (tokenmill.engine.args.ENGINE_OPTIONS), the
        # names of the command line's flags with underscores; an unknown one is a TypeError.
        config = engine_config({"model": model, **options}, where="LLM()")
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if any."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt"/"prompt_token_ids": ...}.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs ``enable_lora``.
        """
        batch = _as_batch(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        return self._run(batch, params, use_tqdm, _loras_per_prompt(lora_request, len(batch)))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``beam_search``: the best ``params.beam_width`` hypotheses of each prompt,
        best first, in the order of the prompts (the same search as ``generate`` with
        ``SamplingParams(use_beam_search=True, n=beam_width)``)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm, lora_request)
        tok = self.engine.tokenizer
        results = []
        for out in outputs:
            prompt = out.prompt_token_ids
            results.append(BeamSearchOutput([
                BeamSearchSequence(tokens=[*prompt, *c.token_ids],
                                   text=tok.decode([*prompt, *c.token_ids],
                                                   skip_special_tokens=False),
                                   cum_logprob=c.cumulative_logprob or 0.0,
                                   num_prompt_tokens=len(prompt),
                                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                for c in out.outputs]))
        return results

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to a list of them."""
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        for conversation in conversations:
            # Special-token text inside the messages stays text (see Tokenizer.encode_chat).
            text, ids = tok.encode_chat(
                list(conversation), add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm,
                         _loras_per_prompt(lora_request, len(prompts)))

    def classify(self, inputs: str | Sequence[str], labels: Sequence[str],
                 instruction: str | None = None) -> list[ClassificationResult]:
        """Sort each input into one of ``labels`` by scoring every label exactly: the
        probability of a label is the softmax, over the labels, of the summed log-probabilities
        of its tokens after the prompt (the chat template with ``instruction`` as the system
        message, a default one naming the labels if None, and the input as the user's).
        Results come back in the order of the inputs; ValueError names a bad argument."""
        tok = self.engine.tokenizer
        scorer = LabelScorer(tok, self.engine.max_model_len, inputs, labels, instruction)
        return run_label_scoring(self.engine, scorer, f"classify{next(self._ids)}")

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (text, token ids, or {"prompt_token_ids": ...}), in
        the order of the prompts, each with ``.embedding`` and ``.prompt_token_ids``. All go
        through the scheduler together: many share each step. ValueError names a bad input
        (nothing of the call stays queued)."""
        if self.engine.cross_encoder:
            raise ValueError("this model is a cross-encoder: it scores pairs of texts "
                             "(LLM.score) and computes no embeddings")
        return self._pool(_as_batch(prompts), pooling_params or PoolingParams(), use_tqdm)

    def _pool(self, batch: list[PromptType], params: PoolingParams,
              use_tqdm: bool) -> list[EmbeddingRequestOutput]:
        """The pooled output of every prompt, in order (see :meth:`embed`)."""
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for prompt in batch:
                rid = f"embed{next(self._ids)}"
                engine.add_request(rid, prompt, params)
                order[rid] = len(order)
        except ValueError as e:
            for rid in order:
                engine.abort_request(rid)
            raise ValueError(f"input {len(order)}: {e}") from None
        results: list[EmbeddingRequestOutput | None] = [None] * len(batch)
        with tqdm(total=len(batch), desc="Embedding", unit="input", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if isinstance(out, EmbeddingRequestOutput) and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the engine stopped without embedding inputs {missing}")
        return results  # type: ignore[return-value]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """vLLM's ``score``: one first text against every second text (1 to N) or the i-th of
        each (N to N), in the order of ``text_2``. On an embedding model, the cosine
        similarity of each pair's two embeddings, each distinct text embedded once; on a
        cross-encoder (reranker), its head's score of the two texts read together.
        ``truncate_prompt_tokens`` cuts longer inputs as ``PoolingParams`` does (a pair: the
        longer text first). ValueError names a bad argument, or an engine that generates
        text."""
        engine = self.engine
        if engine.task != "embed":
            raise ValueError(f"score needs an embedding model or a cross-encoder (task "
                             f"'embed'); this engine has task {engine.task!r}")
        pairs = pair_texts(text_1, text_2)
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        params.validate()
        if engine.cross_encoder:
            prompts: list[PromptType] = [
                {"prompt_token_ids": ids} for ids in cross_encoder_prompts(
                    pairs, engine.tokenizer, params, engine.max_model_len)]
            pooled = self._pool(prompts, params, use_tqdm)
            token_ids = [o.prompt_token_ids for o in pooled]
        else:
            pooled = self._pool(list(pairs.texts), params, use_tqdm)
            token_ids = [pooled[i].prompt_token_ids + pooled[j].prompt_token_ids
                         for i, j in pairs.pairs]
        scores = scores_of(pairs, engine.cross_encoder, [o.embedding for o in pooled])
        return [ScoringRequestOutput(f"score{next(self._ids)}", ids, ScoringOutput(score))
                for ids, score in zip(token_ids, scores, strict=True)]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool | None, loras: list[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, lora_request=lora)
                order[rid] = len(order)
        except ValueError:
            for rid in order:
                engine.abort_request(rid)
            raise
        show = len(prompts) >= PROGRESS_BAR_MIN_PROMPTS if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not show)
        results: list[RequestOutput | None] = [None] * len(prompts)
        out_tokens = 0
        with bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if isinstance(out, RequestOutput) and out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"{out_tokens / elapsed:.1f} out tok/s")
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the engine stopped without finishing prompts {missing}")
        return results  # type: ignore[return-value]


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids or a list of them, got {type(prompts)}")


def _loras_per_prompt(loras: LoRARequest | Sequence[LoRARequest | None] | None,
                      n: int) -> list[LoRARequest | None]:
    if loras is None or isinstance(loras, LoRARequest):
        return [loras] * n
    if not isinstance(loras, list | tuple):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got "
                         f"{type(loras).__name__}")
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
    return list(loras)


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
