"""`tokenmill tokenizer export`: a Hugging Face tokenizer folder that transformers loads
offline and that gives the ids tokenmill's own tokenizer gives (GGUF and HF folders)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.model_loader.tokenizer_export import export_tokenizer, load_for_export

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", "  leading spaces,\ttabs\nand newlines\n\n", "Ünïcödé 日本語 😀 emoji",
         "<|im_start|>user\nspecial tokens as text<|im_end|>", "1234567 and 3.14159",
         "def f(x):\n    return x ** 2  # code", "", "a" * 300]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"}]


def check_same_ids(model: str | None, folder: str) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    mine, _ = load_for_export(model)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == mine.encode(text), text
        assert theirs.decode(mine.encode(text)) == mine.decode(mine.encode(text),
                                                               skip_special_tokens=False)
    if mine.chat_template:
        ids = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == mine.encode_chat(CHAT, add_generation_prompt=True)[1]
    assert theirs.eos_token_id in mine.eos_token_ids


def test_the_embedded_gguf_model(tmp_path) -> None:
    # Through the command line, as the README shows it.
    out = subprocess.run([sys.executable, "-m", "tokenmill", "-q", "tokenizer", "export",
                          str(tmp_path)], capture_output=True, text=True, check=True)
    names = {p.rsplit("/", 1)[-1] for p in out.stdout.split()}
    assert names == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "generation_config.json", "config.json"}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["eos_token"] == "<|im_end|>"
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    check_same_ids(None, str(tmp_path))


def test_a_hugging_face_folder(tmp_path) -> None:
    # The embedded folder export, exported again from the folder it wrote.
    first, second = tmp_path / "a", tmp_path / "b"
    export_tokenizer(None, str(first))
    export_tokenizer(str(first), str(second))
    check_same_ids(str(first), str(second))


def test_a_missing_model_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="nope.gguf"):
        export_tokenizer(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
