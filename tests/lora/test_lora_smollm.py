"""A LoRA adapter on the embedded SmolLM2-135M-Instruct (its GGUF loaded by transformers too):
tokenmill against PEFT on a real model's sizes (30 layers, 9 query and 3 KV heads, 576 wide)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def smollm_adapter(hf_smollm, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    """A random adapter of rank 8 on every projection, scaled to move the model's logprobs by
    about as much as a fine-tune does (alpha 2)."""
    folder = tmp_path_factory.mktemp("smollm_lora")
    torch.manual_seed(7)
    model = peft.get_peft_model(hf_smollm, peft.LoraConfig(
        r=8, lora_alpha=2, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    model.save_pretrained(str(folder))
    model.unload()
    return folder


def test_smollm_adapter_matches_peft(smollm_path: str, hf_smollm, smollm_adapter: Path  # noqa: ANN001
                                     ) -> None:
    llm = LLM(smollm_path, dtype="float32", quantization="none", enable_lora=True,
              max_model_len=512, kv_cache_memory_bytes=64 << 20)
    try:
        tok = llm.get_tokenizer()
        prompt = tok.encode("The three primary colors are red, yellow and")
        params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)
        lora = LoRARequest("smol", 1, str(smollm_adapter))
        out, base = llm.generate([prompt, prompt], params, lora_request=[lora, None])
    finally:
        llm.close()
    model = peft.PeftModel.from_pretrained(hf_smollm, str(smollm_adapter))
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            logits = model(input_ids=ids).logits[0].float()
            greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=12, do_sample=False)[0, len(prompt):]
    finally:
        model.unload()
    rows, targets = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    theirs = logits.log_softmax(-1)[rows, targets]
    ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    ours_base = torch.tensor([lp.logprob for lp in base.prompt_logprobs[1:]])
    assert (theirs - ours_base).abs().max() > 0.2  # the adapter changes the model
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)
    assert out.outputs[0].token_ids == greedy.tolist()
