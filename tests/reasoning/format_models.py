"""Test helper: tiny random Qwen3 folders whose byte-level tokenizers carry a tool-call
format's special tokens and a chat template in that format, so that a forced call's grammar
can spell JSON: gpt-oss's harmony (generation prompt ``<|start|>assistant``, as gpt-oss's),
Mistral's ``[TOOL_CALLS]NAME[ARGS]{...}``, Llama 3's ``<|python_tag|>``, Qwen3-Coder's
``<function=...>`` and the pythonic ``[f(x=1)]``. The Mistral vocabulary has no plain ``[`` and the Llama one no plain
``<`` or ``|``: their markup can only be written as the special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_checkpoints import COMMON, randomize

HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|constrain|>", "<|call|>")
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools "
    "{%- for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
MISTRAL_SPECIALS = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{% for t in tools %} {{ t.function.name }}"
    "{%- endfor %}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}"
    "[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>"
    "{%- else %}{{ m.content }}</s>{% endif %}{% endfor %}")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:"
    "{%- for t in tools %} {{ t.function.name }}{% endfor %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{%- endfor %}<|eom_id|>{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}")
QWEN3_CODER_SPECIALS = ("<|im_start|>", "<|im_end|>")
QWEN3_CODER_WORDS = ("<tool_call>", "</tool_call>")  # added tokens, not special (as Qwen's)
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{%- endfor %}. Call as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# Llama 3.2 / 4's pythonic calls are described in the system prompt, the template has no
# markup of its own (so the server is started with --tool-call-parser pythonic).
PYTHONIC_TEMPLATE = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Call functions as [func(arg=value)]:{% for t in tools %} {{ t.function.name }}"
    "{%- endfor %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{- m.content }}<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}")
# kind -> (special tokens, chat template, eos, bos, bytes left out of the vocabulary).
KINDS: dict[str, tuple[tuple[str, ...], str, str, str | None, str]] = {
    "harmony": (HARMONY_SPECIALS, HARMONY_TEMPLATE, "<|return|>", None, ""),
    "mistral": (MISTRAL_SPECIALS, MISTRAL_TEMPLATE, "</s>", "<s>", "["),
    # No plain "<" or "|": <|python_tag|> can only be the special token.
    "llama3": (LLAMA3_SPECIALS, LLAMA3_TEMPLATE, "<|eot_id|>", "<|begin_of_text|>", "<|"),
    "qwen3_coder": (QWEN3_CODER_SPECIALS, QWEN3_CODER_TEMPLATE, "<|im_end|>", None, ""),
    "pythonic": (LLAMA3_SPECIALS[:4], PYTHONIC_TEMPLATE, "<|eot_id|>", "<|begin_of_text|>",
                 ""),
}
VOCAB = 272  # the model's rows: 256 bytes and the special tokens


def write_byte_tokenizer(path: Path, specials: tuple[str, ...], template: str, eos: str,
                         bos: str | None = None, leave_out: str = "",
                         words: tuple[str, ...] = ()) -> tuple[int, int]:
    """A byte-level BPE tokenizer with no merges (one token per byte, less ``leave_out``),
    then ``specials`` as special tokens; returns the ids of ``bos`` (or of ``eos``) and
    ``eos``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = [c for c in sorted(pre_tokenizers.ByteLevel.alphabet()) if c not in leave_out]
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, special=False) for t in words])
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": eos, "chat_template": template} | ({"bos_token": bos} if bos else {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.token_to_id(bos or eos), tok.token_to_id(eos)


def make_format_model(path: Path, kind: str) -> Path:
    """The random 2-layer Qwen3 with ``kind``'s tokenizer (a key of KINDS)."""
    transformers = pytest.importorskip("transformers")
    path.mkdir(parents=True, exist_ok=True)
    specials, template, eos_text, bos_text, leave_out = KINDS[kind]
    words = QWEN3_CODER_WORDS if kind == "qwen3_coder" else ()
    bos, eos = write_byte_tokenizer(path, specials, template, eos=eos_text, bos=bos_text,
                                    leave_out=leave_out, words=words)
    # The ids the model's generation config names are the tokenizer's own markers.
    config = transformers.Qwen3Config(**{**COMMON, "vocab_size": VOCAB, "bos_token_id": bos,
                                         "eos_token_id": eos,
                                         "max_position_embeddings": 1024},
                                      num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    randomize(model, seed=11)
    model.save_pretrained(path)
    return path
