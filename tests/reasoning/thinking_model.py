"""Test helper: a tiny random Qwen3 folder whose tokenizer carries the thinking markers and a
chat template with Qwen3's ``enable_thinking`` switch, and a server that serves it beside the
embedded SmolLM2 (a model that does not think)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
for sub in ("models", "server"):
    if str(_TESTS / sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / sub))

from hf_checkpoints import COMMON, randomize  # noqa: E402
from server_harness import Server, start_server  # noqa: E402

# The API key of the Anthropic tests' server.
ANTHROPIC_KEY = "anthropic-test-key"
WORDS = 248  # plain words "t0".."t247"; the markup tokens follow
IM_START, IM_END, THINK, END_THINK = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
# The generation prompt opens the thinking (as DeepSeek-R1's and Qwen3-Thinking's do);
# enable_thinking=false writes an empty thinking instead (as Qwen3's does).
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant "
    "{%- if enable_thinking is defined and not enable_thinking %} <think> </think> "
    "{%- else %} <think> {%- endif %}{%- endif %}")


def write_thinking_tokenizer(path: Path) -> dict[str, int]:
    """A word-level tokenizer ("t0".."t247", then the chat and thinking markers as tokens of
    their own, as Qwen3's has them); returns the markers' ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(WORDS)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(IM_START, special=True),
                            AddedToken(IM_END, special=True)])
    # Not special (as in Qwen3's tokenizer): decoding keeps them in the text.
    tok.add_tokens([AddedToken(THINK, special=False), AddedToken(END_THINK, special=False)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": IM_END, "chat_template": TEMPLATE}))
    return {t: tok.token_to_id(t) for t in (IM_START, IM_END, THINK, END_THINK)}


HARMONY_MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
# gpt-oss's harmony format, its generation prompt opening the analysis channel (the thinking);
# the system message carries the reasoning effort, as gpt-oss's does.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "<|start|>assistant<|channel|>analysis<|message|>{%- endif %}")


def write_harmony_tokenizer(path: Path) -> None:
    """A word-level tokenizer ("t0".."t239") with harmony's markers as special tokens and
    its channel names as words of their own."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(240)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in HARMONY_MARKUP])
    tok.add_tokens([AddedToken(w, special=False) for w in ("analysis", "final", "assistant")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|return|>", "chat_template": HARMONY_TEMPLATE}))


def make_thinking_model(path: Path, harmony: bool = False) -> Path:
    """The random 2-layer Qwen3 folder with that tokenizer (``harmony``: the harmony one)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(**{**COMMON, "eos_token_id": WORDS + 1,
                                         "max_position_embeddings": 1024},
                                      num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    randomize(model, seed=7)
    model.save_pretrained(path)
    if harmony:
        write_harmony_tokenizer(path)
    else:
        write_thinking_tokenizer(path)
    return path


def start_thinking_server(root: Path, *args: str,
                          headers: dict[str, str] | None = None) -> Server:
    """`tokenmill serve` with "thinker" (the tiny Qwen3), "harmony" (the same with gpt-oss's
    markup) and "smol" (the embedded SmolLM2)."""
    from tokenmill.model_loader.gguf import embedded_model_path

    model = make_thinking_model(root / "thinker")
    harmony = make_thinking_model(root / "harmony", harmony=True)
    return start_server("--model", f"thinker={model}", "--model", f"harmony={harmony}",
                        "--model",
                        f"smol={embedded_model_path()}", "--max-num-seqs", "8", *args,
                        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                        headers=headers)
