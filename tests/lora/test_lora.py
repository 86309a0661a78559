"""LoRA adapters in the engine: PEFT's outputs for every kind of adapter, several adapters and
the base model in one batch, slots, the prefix cache, tensor parallelism, quantized bases, and
every refusal named."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lora_helpers import PROMPTS, Base, lora_request, make_adapter, peft_greedy, peft_logits
from safetensors.torch import load_file, save_file

from tokenmill import LLM, LoRARequest, PoolingParams, SamplingParams
from tokenmill.cli import build_parser
from tokenmill.engine.args import engine_config_from_args

pytest.importorskip("peft")

# Hugging Face stops at the eos token (id 2) and keeps it: so does the engine.
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def lora_llm(lora_base: Base) -> Iterator[LLM]:
    """Two slots for four adapters: batches of more adapters are split over steps, and
    adapters take turns in the slots."""
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=2,
              max_num_seqs=16)
    yield llm
    llm.close()


def test_references_differ(references: dict[str | None, list[list[int]]]) -> None:
    """Each adapter changes the greedy tokens: matching them means its update was applied."""
    for name, tokens in references.items():
        if name is not None:
            assert tokens != references[None], name


@pytest.mark.parametrize("name", ["all", "qv", "patterns", "mlp"])
def test_adapter_matches_peft(lora_llm: LLM, adapters: dict[str, Path],
                              references: dict[str | None, list[list[int]]], name: str) -> None:
    outputs = lora_llm.generate(PROMPTS, GREEDY, lora_request=lora_request(adapters, name))
    assert _tokens(outputs) == references[name]


def test_logits_match_peft(lora_llm: LLM, lora_base: Base, adapters: dict[str, Path]) -> None:
    """Every prompt position's logprob of the next token, against PEFT's fp32 logits."""
    prompt = PROMPTS[2]
    for name in ("all", "patterns"):
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = lora_llm.generate([prompt], params, lora_request=lora_request(adapters, name))[0]
        ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        theirs = peft_logits(lora_base, adapters[name], prompt).log_softmax(-1)
        expected = theirs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)


def test_mixed_batch(lora_llm: LLM, adapters: dict[str, Path],
                     references: dict[str | None, list[list[int]]]) -> None:
    """Four adapters and the base model in one call with two slots: each prompt gets its own
    adapter's tokens, whatever shares its steps."""
    names = ["all", None, "qv", "patterns", "mlp", None, "all", "mlp"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [None if n is None else lora_request(adapters, n) for n in names]
    outputs = lora_llm.generate(prompts, GREEDY, lora_request=loras)
    expected = [references[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert _tokens(outputs) == expected


def test_fused_stack_runs_adapter_rows(lora_llm: LLM, adapters: dict[str, Path],
                                       references: dict[str | None, list[list[int]]],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the fused layer stack computes the adapters' updates too (decode and
    prefill steps): the LoRA steps above ran there, not in model.forward."""
    fused = lora_llm.engine.core.executor.runner.cpu_program
    assert fused is not None and fused.lora
    seen: list[object] = []
    forward = fused.forward

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(args[3] if len(args) > 3 else None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(fused, "forward", counting)
    loras = [lora_request(adapters, "all"), None, lora_request(adapters, "qv")]
    outputs = lora_llm.generate(PROMPTS, GREEDY, lora_request=loras)
    assert _tokens(outputs) == [references["all"][0], references[None][1],
                                references["qv"][2]]
    assert any(step is not None for step in seen)


def test_eager_path(lora_base: Base, adapters: dict[str, Path],
                    references: dict[str | None, list[list[int]]],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fused stack (other CPUs' fallback, GPUs) model.forward adds the updates."""
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=2)
    try:
        assert llm.engine.core.executor.runner.cpu_program is None
        names = ["patterns", None, "mlp", "all"]
        outputs = llm.generate([PROMPTS[i % 3] for i in range(4)], GREEDY,
                               lora_request=[None if n is None else lora_request(adapters, n)
                                             for n in names])
        assert _tokens(outputs) == [references[n][i % 3] for i, n in enumerate(names)]
    finally:
        llm.close()


def test_prefix_cache_is_per_adapter(lora_llm: LLM, lora_base: Base,
                                     adapters: dict[str, Path]) -> None:
    """The same prompt's blocks are reused under the same adapter only."""
    prompt = list(range(60, 79))  # 19 tokens, in no other test: one full block of 16
    names = ["mlp", "mlp", "qv", None, "qv"]
    outputs = [lora_llm.generate([prompt], GREEDY,
                                 lora_request=None if n is None else lora_request(adapters, n))[0]
               for n in names]
    assert [o.metrics.num_cached_tokens for o in outputs] == [0, 16, 0, 0, 16]
    assert _tokens(outputs) == [
        peft_greedy(lora_base, None if n is None else adapters[n], prompt, 8) for n in names]


def test_samples_share_the_adapter(lora_llm: LLM, adapters: dict[str, Path],
                                   references: dict[str | None, list[list[int]]]) -> None:
    """n > 1: every sample runs the request's adapter (forks share its prompt's blocks)."""
    params = SamplingParams(temperature=0, max_tokens=8, n=3)
    out = lora_llm.generate([PROMPTS[0]], params, lora_request=lora_request(adapters, "qv"))[0]
    assert [c.token_ids for c in out.outputs] == [references["qv"][0]] * 3


def test_one_slot(lora_base: Base, adapters: dict[str, Path],
                  references: dict[str | None, list[list[int]]]) -> None:
    """max_loras 1: one adapter per step; the others wait, and the slot changes hands."""
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=1)
    try:
        names = ["qv", "mlp", "qv", None, "all"]
        outputs = llm.generate([PROMPTS[1]] * len(names), GREEDY,
                               lora_request=[None if n is None else lora_request(adapters, n)
                                             for n in names])
        assert _tokens(outputs) == [references[n][1] for n in names]
    finally:
        llm.close()


def test_ngram_speculation(lora_base: Base, adapters: dict[str, Path],
                           references: dict[str | None, list[list[int]]]) -> None:
    """Drafts are verified by the adapted model: greedy tokens are the adapter's."""
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, speculative="ngram",
              ngram_min=1)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=lora_request(adapters, "all"))
        assert _tokens(outputs) == references["all"]
    finally:
        llm.close()


def test_tensor_parallel(lora_base: Base, adapters: dict[str, Path],
                         references: dict[str | None, list[list[int]]]) -> None:
    """Two ranks each keep their slices of the adapters (B rows of qkv and gate-up, A
    columns of o and down); the all-reduce adds their updates."""
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, tensor_parallel_size=2)
    try:
        loras = [lora_request(adapters, "all"), lora_request(adapters, "patterns"), None]
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
        assert _tokens(outputs) == [references["all"][0], references["patterns"][1],
                                    references[None][2]]
    finally:
        llm.close()


def test_quantized_base(lora_base: Base, adapters: dict[str, Path]) -> None:
    """An int8 base with an fp32 adapter (QLoRA-style serving): the adapted logprobs are as
    close to PEFT's as the int8 base's are to the fp32 base's (the adapter adds no error of
    its own), while the adapter moves them far more than that."""
    prompt = PROMPTS[2]
    targets = torch.tensor(prompt[1:])
    rows = torch.arange(len(prompt) - 1)
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, quantization="int8")
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        ours = {}
        for name in (None, "all"):
            lora = None if name is None else lora_request(adapters, name)
            out = llm.generate([prompt], params, lora_request=lora)[0]
            ours[name] = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    finally:
        llm.close()
    with torch.no_grad():
        base_logits = lora_base.hf_model(input_ids=torch.tensor([prompt])).logits[0]
    theirs_base = base_logits.log_softmax(-1)[rows, targets]
    theirs = peft_logits(lora_base, adapters["all"], prompt).log_softmax(-1)[rows, targets]
    base_error = (ours[None] - theirs_base).abs().max().item()
    adapted_error = (ours["all"] - theirs).abs().max().item()
    assert (theirs - theirs_base).abs().max() > 1.0  # 2.05 here: the adapter's effect
    assert adapted_error < 0.1  # 0.062 here (the int8 base: 0.060)
    assert adapted_error < 1.5 * base_error + 0.01


def test_add_list_remove(lora_llm: LLM, adapters: dict[str, Path]) -> None:
    engine = lora_llm.engine
    request = LoRARequest("extra", 99, str(adapters["qv"]))
    engine.add_lora(request)
    assert 99 in engine.list_loras()
    assert engine.remove_lora(99)
    assert 99 not in engine.list_loras()
    assert not engine.remove_lora(99)


# ------------------------------------------------------------------------ refusals


def _broken(adapters: dict[str, Path], tmp_path: Path, config: dict | None = None,
            tensors: dict | None = None, drop: str | None = None) -> Path:
    """A copy of the 'all' adapter with config fields replaced, tensors replaced or one
    tensor dropped."""
    folder = tmp_path / "broken"
    shutil.copytree(adapters["all"], folder)
    if config is not None:
        data = json.loads((folder / "adapter_config.json").read_text())
        data.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None or drop is not None:
        file = folder / "adapter_model.safetensors"
        weights = load_file(str(file))
        weights.update(tensors or {})
        weights.pop(drop or "", None)
        save_file(weights, str(file))
    return folder


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("change, message", [
    (dict(config={"use_dora": True}), r"DoRA adapters \(use_dora\)"),
    (dict(config={"modules_to_save": ["lm_head"]}), r"modules_to_save"),
    (dict(config={"bias": "all"}), r"trained biases are not supported \(bias='all'"),
    (dict(config={"peft_type": "IA3"}), r"peft_type is 'IA3'"),
    (dict(config={"lora_alpha": "big"}), r"'lora_alpha' must be a positive number"),
    (dict(tensors={Q_A: torch.zeros(8, 32)}),
     r"model\.layers\.0\.self_attn\.q_proj has lora_A \(8, 32\).*another base model"),
    (dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
     r"tensor 'base_model\.model\.lm_head\.lora_A\.weight' is not a LoRA A or B matrix"),
    (dict(tensors={"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight":
                   torch.zeros(8, 64)}), r"is for layer 7, but the model has 2 layers"),
    (dict(drop=Q_B), r"model\.layers\.0\.self_attn\.q_proj has no lora_B matrix"),
])
def test_bad_adapter_is_named(lora_llm: LLM, adapters: dict[str, Path], tmp_path: Path,
                              references: dict[str | None, list[list[int]]], change: dict,
                              message: str) -> None:
    folder = _broken(adapters, tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", 50, str(folder)))
    # Nothing was queued; the engine goes on.
    out = lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=lora_request(adapters, "qv"))
    assert _tokens(out) == references["qv"][:1]


def test_missing_folder_and_files(lora_llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'nope' \(.*\): the path is not a directory"):
        lora_llm.engine.add_lora(LoRARequest("nope", 51, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        lora_llm.engine.add_lora(LoRARequest("empty", 52, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors or adapter_model\.bin"):
        lora_llm.engine.add_lora(LoRARequest("empty", 52, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"adapter_config\.json is not readable JSON"):
        lora_llm.engine.add_lora(LoRARequest("empty", 52, str(tmp_path)))


def test_rank_above_max(lora_base: Base, adapters: dict[str, Path], tmp_path: Path) -> None:
    big = make_adapter(lora_base, tmp_path / "r32", seed=5, r=32, lora_alpha=32)
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_lora_rank=16)
    try:
        with pytest.raises(ValueError, match=r"rank 32, more than max_lora_rank 16 \(start "
                                             r"the engine with --max-lora-rank 32\)"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("r32", 1, str(big)))
    finally:
        llm.close()


def test_id_names_one_folder(lora_llm: LLM, adapters: dict[str, Path]) -> None:
    lora_llm.engine.add_lora(LoRARequest("one", 60, str(adapters["qv"])))
    with pytest.raises(ValueError, match=r"lora_int_id 60 already names adapter 'one'"):
        lora_llm.engine.add_lora(LoRARequest("two", 60, str(adapters["mlp"])))
    lora_llm.engine.remove_lora(60)


def test_engine_without_lora(lora_base: Base, adapters: dict[str, Path]) -> None:
    llm = LLM(str(lora_base.path), dtype="float32")
    try:
        with pytest.raises(ValueError, match=r"this engine runs no LoRA adapters \(start it "
                                             r"with enable_lora"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=lora_request(adapters, "qv"))
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY))  # still serving
    finally:
        llm.close()


def test_request_and_argument_checks(lora_llm: LLM, adapters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(adapters["qv"]))
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, str(adapters["qv"]))
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        lora_llm.generate(PROMPTS[:2], GREEDY, lora_request=[lora_request(adapters, "qv")])
    with pytest.raises(ValueError, match="embedding requests run the base model"):
        lora_llm.engine.add_request("e", "t5 t6", PoolingParams(),
                                    lora_request=lora_request(adapters, "qv"))


def test_configurations_refused(lora_base: Base) -> None:
    with pytest.raises(ValueError, match="deterministic steps cannot run LoRA adapters"):
        LLM(str(lora_base.path), enable_lora=True, deterministic=True)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras"):
        LLM(str(lora_base.path), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        LLM(str(lora_base.path), enable_lora=True, max_lora_rank=0)


def test_encoder_refused() -> None:
    from tokenmill.model_loader import embedded_embedding_model_path

    with pytest.raises(ValueError, match="LoRA adapters apply to decoder models; "
                                         "BertModel is an encoder"):
        LLM(embedded_embedding_model_path(), task="embed", enable_lora=True)


def test_cli_flags() -> None:
    args = build_parser().parse_args(["generate", "hi", "--enable-lora", "--max-loras", "3",
                                      "--max-lora-rank", "64", "--max-cpu-loras", "8"])
    lora = engine_config_from_args(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (
        True, 3, 64, 8)
    assert not engine_config_from_args(build_parser().parse_args(["serve"])).lora.enable_lora


def test_adapters_in_use_stay_in_memory(lora_base: Base, adapters: dict[str, Path],
                                        references: dict[str | None, list[list[int]]],
                                        tmp_path: Path) -> None:
    """An adapter that waiting requests run stays in host memory past --max-cpu-loras and
    past its removal: its folder is not read again, and may be gone meanwhile."""
    folder = tmp_path / "qv-copy"
    shutil.copytree(adapters["qv"], folder)
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=1,
              max_cpu_loras=1)
    try:
        engine = llm.engine
        engine.add_request("waits", PROMPTS[0], GREEDY,
                           lora_request=LoRARequest("qv", 7, str(folder)))
        engine.add_lora(lora_request(adapters, "mlp"))  # past the capacity of one
        assert engine.remove_lora(7)  # removed while its request waits
        shutil.rmtree(folder)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert [o.outputs[0].token_ids for o in outputs] == [references["qv"][0]]
        assert 7 not in engine.list_loras()  # gone once its request ended
        with pytest.raises(ValueError, match="the path is not a directory"):
            engine.add_lora(LoRARequest("qv", 8, str(folder)))
    finally:
        llm.close()


def test_beam_search_with_adapters_matches_peft(lora_llm: LLM, lora_base: Base,
                                                adapters: dict[str, Path]) -> None:
    """Beam searches of two adapters and of the base model in one batch: each beam runs its
    search's adapter (new beams too), as PEFT's own beam search does."""
    peft = pytest.importorskip("peft")
    names = ["all", None, "mlp"]
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=8)
    outs = lora_llm.generate([PROMPTS[0]] * 3, params,
                             lora_request=[None if n is None else lora_request(adapters, n)
                                           for n in names])
    for name, out in zip(names, outs, strict=True):
        model = lora_base.hf_model if name is None else peft.PeftModel.from_pretrained(
            lora_base.hf_model, str(adapters[name]))
        try:
            with torch.no_grad():
                ref = model.generate(input_ids=torch.tensor([PROMPTS[0]]), num_beams=3,
                                     num_return_sequences=3, max_new_tokens=8,
                                     do_sample=False, pad_token_id=0)
        finally:
            if name is not None:
                model.unload()
        want = [seq[len(PROMPTS[0]):].tolist() for seq in ref]
        want = [w[:w.index(2) + 1] if 2 in w else w for w in want]  # the eos ends them
        assert [c.token_ids for c in out.outputs] == want, name
    assert not any(lora_llm.engine.core.scheduler.lora_in_use(i) for i in range(1, 5))
