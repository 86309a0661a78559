"""What the engine hands back to its users, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """The logprob of one chosen token and of the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass
class ComputeUsage:
    """Compute time (s), energy (J) and cost (USD) of a request or of steps."""

    compute_seconds: float = 0.0
    energy_joules: float = 0.0
    cost_usd: float = 0.0
    # True when any part of the energy was estimated rather than read from a counter.
    energy_estimated: bool = False

    def add(self, other: ComputeUsage) -> None:
        self.compute_seconds += other.compute_seconds
        self.energy_joules += other.energy_joules
        self.cost_usd += other.cost_usd
        self.energy_estimated |= other.energy_estimated

    def scaled(self, factor: float) -> ComputeUsage:
        return ComputeUsage(self.compute_seconds * factor, self.energy_joules * factor,
                            self.cost_usd * factor, self.energy_estimated)

    def copy(self) -> ComputeUsage:
        return self.scaled(1.0)

    @staticmethod
    def total(usages: list[ComputeUsage]) -> ComputeUsage:
        out = ComputeUsage()
        for u in usages:
            out.add(u)
        return out


@dataclass
class RequestMetrics:
    """Timestamps of one request, from ``time.monotonic()``; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache (None until the request was scheduled; for n > 1,
    # the first sample's, which computes the prompt the others share).
    num_cached_tokens: int | None = None
    # The request's max_tokens (None: up to the context), for vLLM's request_params_max_tokens.
    max_tokens: int | None = None
    # Compute time, energy and cost so far (every sample of an n > 1 request together).
    usage: ComputeUsage = field(default_factory=ComputeUsage)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # The token id or stop string that ended the output, when one did.
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Seconds between consecutive tokens of this sequence.
    inter_token_latencies: list[float] = field(default_factory=list)
    # The sum of the raw logprobs of all its tokens so far (not a delta, even in DELTA mode);
    # None when the engine did not compute them.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: the prompt and all outputs so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search`` (vLLM's fields): ``tokens`` and ``text`` are the
    whole sequence, prompt included."""

    tokens: list[int]
    text: str
    cum_logprob: float
    num_prompt_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt's beam search, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class ClassificationResult:
    """One input's classification: the most likely label and every label's probability.

    ``probs`` is the softmax over the labels of ``logprobs``, each label's summed token
    log-probabilities after the prompt; both keep the order the labels were given in."""

    index: int
    label: str
    probs: dict[str, float]
    logprobs: dict[str, float]
    # The input's prompt once plus every label's tokens.
    num_prompt_tokens: int


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding: the pooled vector of its whole prompt.

    ``finish_reason`` is "stop" once computed; an aborted request ends with "abort" and an
    empty ``embedding``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]
    metrics: RequestMetrics
    finished: bool = True
    finish_reason: str = "stop"


@dataclass
class ScoringOutput:
    """A pair's score: on an embedding model the cosine similarity of its two texts'
    embeddings, in [-1, 1]; on a cross-encoder its head's sigmoid, in (0, 1)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """One pair of ``LLM.score``, shaped as vLLM's: ``outputs.score``, and the token ids of
    both texts, the first's then the second's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
