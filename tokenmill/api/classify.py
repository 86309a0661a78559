"""POST /v1/classify (tokenmill's): sort each input into one of the given labels by scoring
every label exactly (tokenmill/engine/classify.py), validated and answered the same way by the
server and by batch files."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import StrictModel, UsageInfo
from tokenmill.api.response_building import collect, usage_info
from tokenmill.api.validation import ServedModel
from tokenmill.engine.async_llm import RequestGroup
from tokenmill.engine.classify import (
    MAX_LABEL_REQUESTS_IN_FLIGHT,
    ClassifyInputError,
    LabelRequest,
    LabelScorer,
)
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import ClassificationResult
from tokenmill.sampling_params import SamplingParams

# Inputs in one request, and label scores (inputs x labels, one engine request each): a file
# of many more goes through `tokenmill batch`.
MAX_CLASSIFY_INPUTS = 256
MAX_LABEL_SCORES = 2048

# Queues engine requests (prompts, shared parameters, id prefix), HTTP errors for refusals.
Submit = Callable[[Sequence[PromptType], SamplingParams, str], Awaitable[RequestGroup]]


class ClassifyRequest(StrictModel):
    """POST /v1/classify: one input or a list of them, the labels to choose from, and the
    instruction for the system message (default: one that names the labels)."""

    model: str | None = None
    input: str | list[str]
    labels: list[str]
    instruction: str | None = None


class Classification(BaseModel):
    """One input's answer: the most likely label and the probability of each."""

    index: int
    label: str
    probs: dict[str, float]


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Classification]
    usage: UsageInfo


@dataclass
class ClassifyCall:
    """A validated classify request: the label scorer that plans its engine requests."""

    id_prefix: ClassVar[str] = "classify"
    req: ClassifyRequest
    scorer: LabelScorer

    def response(self, results: list[ClassificationResult], model: str, rid: str,
                 created: int) -> ClassifyResponse:
        """The response body of the scored request."""
        data = [Classification(index=r.index, label=r.label, probs=r.probs) for r in results]
        return ClassifyResponse(id=rid, created=created, model=model, data=data,
                                usage=self.usage())

    def usage(self) -> UsageInfo:
        return usage_info(self.scorer.num_prompt_tokens, 0)


def prepare_classify(req: ClassifyRequest, served: ServedModel) -> ClassifyCall:
    """The label scorer of a classify request; 400 names the bad field. Shared by the server
    and the batch job, so both accept and reject the same bodies."""
    if isinstance(req.input, list):
        if len(req.input) > MAX_CLASSIFY_INPUTS:
            raise bad_request(f"input may hold at most {MAX_CLASSIFY_INPUTS} texts, got "
                              f"{len(req.input)}; classify more with a batch file", "input")
        if len(req.input) * len(req.labels) > MAX_LABEL_SCORES:
            raise bad_request(f"{len(req.input)} inputs x {len(req.labels)} labels is more than "
                              f"the {MAX_LABEL_SCORES} label scores a request may ask for; "
                              "send fewer inputs, or a batch file", "input")
    try:
        scorer = LabelScorer(served.tokenizer, served.max_model_len, req.input, req.labels,
                             req.instruction,
                             max_chars=served.max_model_len * MAX_CHARS_PER_TOKEN)
    except ClassifyInputError as e:
        raise bad_request(str(e), e.param) from None
    return ClassifyCall(req, scorer)


async def score_labels(scorer: LabelScorer, submit: Submit,
                       max_seqs: int) -> list[ClassificationResult]:
    """Score every label through an asyncio engine client, at most ``max_seqs`` label
    requests in flight (whole inputs at a time); each input's first label runs before its
    others, which then find the prompt in the prefix cache."""
    max_seqs = max(1, min(max_seqs, MAX_LABEL_REQUESTS_IN_FLIGHT))
    slots = asyncio.Semaphore(max(1, max_seqs // len(scorer.labels)))

    async def one_input(first: LabelRequest) -> None:
        async with slots:
            follow_ups = await _score(scorer, [first], submit)
            # Chunks of at most max_seqs, so that many labels fit a small server.
            for start in range(0, len(follow_ups), max_seqs):
                await _score(scorer, follow_ups[start:start + max_seqs], submit)

    tasks = [asyncio.ensure_future(one_input(first)) for first in scorer.first_requests()]
    try:
        await asyncio.gather(*tasks)
    finally:  # a failure (or a cancel: the client left) stops the other inputs too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return scorer.results()


async def _score(scorer: LabelScorer, requests: list[LabelRequest],
                 submit: Submit) -> list[LabelRequest]:
    """Run label requests of one input to the end; the follow-ups they hand back."""
    group = await submit([r.prompt for r in requests], requests[0].params, "classify")
    result = await collect(group, len(requests), 1)
    follow_ups: list[LabelRequest] = []
    for index, request in enumerate(requests):
        if result.choices[index][0].finish_reason == "abort":
            raise APIError(503, "the request was aborted before its labels were scored",
                           code="aborted")
        follow_ups += scorer.record(request, result.prompt_logprobs[index])
    return follow_ups
