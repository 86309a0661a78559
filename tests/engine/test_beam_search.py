"""Beam search (SamplingParams.use_beam_search, LLM.beam_search) against transformers'
``generate(num_beams=n)`` on a tiny random Llama in float32, under every scheduling the
engine does: batches with other requests, chunked prefill, preemption, no prefix cache,
asynchronous scheduling, speculative decoding, two tensor-parallel ranks."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from hf_checkpoints import make_checkpoint, write_tokenizer  # noqa: E402

from tokenmill import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.output_processor import OutputKind  # noqa: E402

PROMPTS = [[5, 9, 33, 100, 7, 250, 18, 4, 61, 3, 77, 200],
           [40, 41, 42, 43, 44, 45, 46],
           [1, 17, 17, 99, 120, 3, 8, 8, 8, 64, 32, 16, 128, 255, 6, 7, 19, 200, 11]]


@dataclass
class Model:
    """A saved tiny Llama whose eos is a token its beams often choose (so hypotheses end on
    it), and its transformers model."""

    path: Path
    hf_model: torch.nn.Module
    eos: int


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("beam_llama")
    checkpoint = make_checkpoint("llama", path)
    hf = checkpoint.hf_model
    # The eos: the most frequent token of the first prompt's greedy continuations.
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=24, do_sample=False,
                          num_beams=4, num_return_sequences=4, eos_token_id=None,
                          pad_token_id=0)
    counts = torch.bincount(out[:, len(PROMPTS[0]):].flatten(), minlength=256)
    eos = int(counts.argmax())
    write_tokenizer(path, eos_id=eos)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    hf.generation_config.eos_token_id = eos
    return Model(path, hf, eos)


@pytest.fixture(scope="module")
def llm(model: Model) -> LLM:
    return LLM(str(model.path), dtype="float32")


@dataclass
class Beam:
    token_ids: list[int]
    score: float


def hf_beams(model: Model, prompt: list[int], n: int, max_tokens: int,
             length_penalty: float = 1.0, early_stopping: bool | str = False,
             min_tokens: int = 0) -> list[Beam]:
    """transformers' n best hypotheses (output tokens up to and with the eos) and scores."""
    with torch.no_grad():
        out = model.hf_model.generate(
            torch.tensor([prompt]), num_beams=n, num_return_sequences=n, do_sample=False,
            max_new_tokens=max_tokens, min_new_tokens=min_tokens or None,
            length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=model.eos, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = seq[len(prompt):].tolist()
        if model.eos in tokens:
            tokens = tokens[:tokens.index(model.eos) + 1]
        beams.append(Beam(tokens, float(score)))
    return beams


def beam_params(n: int, max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(n=n, use_beam_search=True, max_tokens=max_tokens, **kw)


def assert_same_beams(out, ref: list[Beam], length_penalty: float = 1.0,
                      eos: int | None = None) -> None:
    assert [c.token_ids for c in out.outputs] == [b.token_ids for b in ref]
    for c, b in zip(out.outputs, ref, strict=True):
        score = c.cumulative_logprob / len(c.token_ids) ** length_penalty
        assert score == pytest.approx(b.score, abs=2e-4)
        ended = eos is not None and c.token_ids[-1] == eos
        assert c.finish_reason == ("stop" if ended else "length")


CONFIGS = [  # n, max_tokens, length_penalty, early_stopping
    (4, 16, 1.0, False),
    (3, 12, 0.0, True),
    (4, 14, 2.0, "never"),
    (2, 10, -1.0, False),
    (6, 9, 0.5, True),
]


@pytest.mark.parametrize(("n", "max_tokens", "length_penalty", "early_stopping"), CONFIGS)
def test_beams_match_transformers(llm: LLM, model: Model, n: int, max_tokens: int,
                                  length_penalty: float, early_stopping: bool | str) -> None:
    params = beam_params(n, max_tokens, length_penalty=length_penalty,
                         early_stopping=early_stopping)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_beams(model, prompt, n, max_tokens, length_penalty, early_stopping)
        assert_same_beams(out, ref, length_penalty, model.eos)


def test_hypotheses_end_on_eos_and_on_length(llm: LLM, model: Model) -> None:
    """The parity above covers both endings: some hypotheses stop on the eos, some run to
    the length limit."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], beam_params(4, 16))
    reasons = {c.finish_reason for out in outs for c in out.outputs}
    assert reasons == {"stop", "length"}


def test_min_tokens_matches_transformers(llm: LLM, model: Model) -> None:
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, beam_params(4, 12, min_tokens=6))[0]
    assert_same_beams(out, hf_beams(model, PROMPTS[0], 4, 12, min_tokens=6), eos=model.eos)
    assert all(len(c.token_ids) > 6 for c in out.outputs)


def test_ignore_eos_runs_every_beam_to_the_limit(llm: LLM, model: Model) -> None:
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       beam_params(3, 10, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [10, 10, 10]
    assert {c.finish_reason for c in out.outputs} == {"length"}


def test_one_beam_without_eos_is_greedy(llm: LLM) -> None:
    """(transformers runs num_beams=1 as greedy search: no reference there.)"""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    beams = llm.generate(prompts, beam_params(1, 10, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                  ignore_eos=True))
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_stop_token_ids_end_hypotheses_with_a_stop_reason(llm: LLM, model: Model) -> None:
    """A stop token id ends a hypothesis as the eos does (here it is the eos, with
    ignore_eos), and is its stop_reason."""
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       beam_params(4, 16, ignore_eos=True, stop_token_ids=[model.eos]))[0]
    assert_same_beams(out, hf_beams(model, PROMPTS[0], 4, 16), eos=model.eos)
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert stopped and all(c.stop_reason == model.eos for c in stopped)


def test_beam_search_api(llm: LLM, model: Model) -> None:
    """vLLM's LLM.beam_search: whole sequences (prompt included), best first, the same
    hypotheses as generate with use_beam_search."""
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                           BeamSearchParams(beam_width=3, max_tokens=12))
    gens = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], beam_params(3, 12))
    tok = llm.get_tokenizer()
    for prompt, out, gen in zip(PROMPTS, outs, gens, strict=False):
        assert [s.tokens for s in out.sequences] == [prompt + c.token_ids for c in gen.outputs]
        assert [s.output_tokens for s in out.sequences] == [c.token_ids for c in gen.outputs]
        assert out.sequences[0].text == tok.decode(out.sequences[0].tokens,
                                                   skip_special_tokens=False)
        assert [s.cum_logprob for s in out.sequences] == [
            c.cumulative_logprob for c in gen.outputs]


def test_logprobs_are_those_of_each_hypothesis_token(llm: LLM, model: Model) -> None:
    """With logprobs=k each hypothesis carries, per token, the logprob, rank and top k the
    model gives it after the tokens before it (checked by scoring the hypothesis as a
    prompt), summing to its cumulative logprob; the beams are those without logprobs."""
    prompt = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": prompt}, beam_params(4, 12, logprobs=3))[0]
    plain = llm.generate({"prompt_token_ids": prompt}, beam_params(4, 12))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    for c in out.outputs:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert sum(lp.logprob for lp in c.logprobs) == pytest.approx(c.cumulative_logprob)
        scored = llm.generate({"prompt_token_ids": prompt + c.token_ids}, SamplingParams(
            max_tokens=1, prompt_logprobs=3, prompt_logprobs_start=len(prompt)))[0]
        want = scored.prompt_logprobs[len(prompt):]
        for got, ref in zip(c.logprobs, want, strict=True):
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert got.rank == ref.rank
            assert list(got.top) == list(ref.top)
            assert list(got.top.values()) == pytest.approx(list(ref.top.values()), abs=1e-4)


def test_mixed_with_other_requests(llm: LLM, model: Model) -> None:
    """Beam searches of different widths beside sampled and greedy requests in one batch."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [beam_params(4, 12), SamplingParams(temperature=0.8, seed=3, max_tokens=20, n=2),
              beam_params(2, 10, length_penalty=0.0)]
    outs = llm.generate(prompts, params)
    assert_same_beams(outs[0], hf_beams(model, PROMPTS[0], 4, 12), eos=model.eos)
    assert_same_beams(outs[2], hf_beams(model, PROMPTS[2], 2, 10, 0.0), 0.0, model.eos)
    alone = llm.generate(prompts[1], params[1])[0]
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in alone.outputs]


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=8),  # the prompts' prefill in chunks
    dict(enable_prefix_caching=False),
    dict(num_kv_blocks=25, block_size=4),  # too few blocks for all beams: preemptions
    dict(async_scheduling=True),
    dict(speculative="ngram", ngram_min=1, ngram_max=2),
    dict(max_num_seqs=4),  # new beams wait for room in the batch
], ids=["chunked", "no-prefix-cache", "preemption", "async", "ngram", "few-seqs"])
def test_scheduling_does_not_change_the_beams(model: Model, options: dict) -> None:
    llm = LLM(str(model.path), dtype="float32", **options)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [beam_params(4, 12), SamplingParams(temperature=0, max_tokens=16),
              beam_params(3, 12)]
    outs = llm.generate(prompts, params)
    assert_same_beams(outs[0], hf_beams(model, PROMPTS[0], 4, 12), eos=model.eos)
    assert_same_beams(outs[2], hf_beams(model, PROMPTS[2], 3, 12), eos=model.eos)
    core = llm.engine.core
    if "num_kv_blocks" in options:
        assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_usable_blocks
    assert not core.scheduler.requests and not core.scheduler.beams.groups


def test_two_tensor_parallel_ranks(model: Model) -> None:
    llm = LLM(str(model.path), dtype="float32", tensor_parallel_size=2)
    try:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, beam_params(4, 12))[0]
    finally:
        llm.close()
    assert_same_beams(out, hf_beams(model, PROMPTS[0], 4, 12), eos=model.eos)


def test_beams_share_their_kv_blocks(model: Model) -> None:
    """The beams read the prompt's full blocks from the same physical blocks, and a
    parent's partly filled block is copied only for its children after the first."""
    engine = LLMEngine(LLM(str(model.path), dtype="float32").engine.config)
    core = engine.core
    schedules = []
    execute = core.executor.execute

    def recording(sched, *args):  # noqa: ANN202
        schedules.append(sched)
        return execute(sched, *args)

    core.executor.execute = recording
    prompt = list(range(3, 3 + 40))  # 2 full blocks of 16 and a partial one
    engine.add_request("b", {"prompt_token_ids": prompt}, beam_params(4, 8))
    engine.step()  # the prompt, then the first selection: 4 beams of the root
    engine.step()  # each beam writes its token into the root's partial block
    beams = schedules[1].new_requests
    assert len(beams) == 4
    assert {tuple(b.block_ids[:2]) for b in beams} == {tuple(schedules[0].new_requests[0]
                                                             .block_ids[:2])}
    assert len({b.block_ids[2] for b in beams}) == 4
    assert len(schedules[1].kv_copies) == 3  # the fourth writes into the root's own block
    sched = core.scheduler
    while engine.has_unfinished_requests():
        engine.step()
    # Later steps copy one block per extra child of a parent, never more.
    for step in schedules[2:]:
        parents = [b.token_ids[:-1] for b in step.new_requests]
        assert len(step.kv_copies) <= len(parents) - len({tuple(p) for p in parents})
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_abort_ends_every_beam(model: Model) -> None:
    engine = LLMEngine(LLM(str(model.path), dtype="float32").engine.config)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, beam_params(4, 30),
                       kind=OutputKind.DELTA)
    engine.add_request("g", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):
        engine.step()
    out = engine.abort_request("a")
    assert out is not None and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
    sched = engine.core.scheduler
    assert not sched.beams.groups
    assert all(r.request_id == "g" for r in sched.running)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].request_id == "g" and len(outs[-1].outputs[0].token_ids) == 8
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_streaming_delivers_the_hypotheses_at_the_end(llm: LLM, model: Model) -> None:
    engine = llm.engine
    engine.add_request("s", {"prompt_token_ids": PROMPTS[1]}, beam_params(3, 10),
                       kind=OutputKind.DELTA)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == "s")
    assert len(outs) == 1 and outs[0].finished
    ref = hf_beams(model, PROMPTS[1], 3, 10)
    assert [c.token_ids for c in outs[0].outputs] == [b.token_ids for b in ref]
    final = llm.generate({"prompt_token_ids": PROMPTS[1]}, beam_params(3, 10))[0]
    assert [c.text for c in outs[0].outputs] == [c.text for c in final.outputs]
    assert all(c.text.split() == [f"t{t}" for t in c.token_ids] for c in final.outputs)


@pytest.mark.parametrize(("kw", "field"), [
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(stop=["t5"]), "stop"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(logit_bias={3: 1.0}), "logit_bias"),
    (dict(length_penalty=11.0), "length_penalty"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(max_tokens=None), "max_tokens"),
])
def test_refused_params_name_the_field(kw: dict, field: str) -> None:
    options = dict(n=2, use_beam_search=True, max_tokens=8)
    options.update(kw)
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_refused_by_the_engine(llm: LLM, model: Model) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(model.path), dtype="float32", max_num_seqs=2).generate(
            "t5 t6", beam_params(3, 4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate("t5 t6", beam_params(64, 4, stop_token_ids=[3, 4], min_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search("t5 t6", BeamSearchParams(beam_width=2, max_tokens=4,
                                                  temperature=0.7))
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search("t5 t6", BeamSearchParams(beam_width=0, max_tokens=4))
    # The engine goes on.
    assert len(llm.generate("t5 t6", beam_params(2, 4))[0].outputs) == 2


def test_the_benchmarks_request_per_step_mode_finds_the_same_beams(llm: LLM) -> None:
    """`tokenmill bench beam` compares with vLLM's way of searching (a one-token request per
    beam and step); without an eos both keep the top n by summed logprob, so both must end
    with the same beams: the benchmark's modes do the same work."""
    from tokenmill.bench.beam import request_per_step

    prompts = [p[:8] for p in PROMPTS]
    theirs = request_per_step(llm, prompts, 3, 6)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        beam_params(3, 6, ignore_eos=True))
    assert theirs == [[p + c.token_ids for c in out.outputs] for p, out in zip(
        prompts, ours, strict=True)]
