"""Split GGUF models (llama.cpp's gguf-split: NAME-00001-of-00003.gguf ...): the embedded model
written again in three shards by gguf's own split writer loads as one model, from any shard,
and answers exactly as the single file does; a missing or misnumbered shard is a clear error."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_split_files import write_split_copy

from tokenmill.model_loader.gguf import embedded_model_path, load_gguf, load_gguf_tokenizer
from tokenmill.model_loader.gguf_split import read_gguf

SHARDS = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_split_copy(embedded_model_path(), tmp_path_factory.mktemp("split"), SHARDS)


def test_any_shard_opens_the_whole_model(shards: list[Path]) -> None:
    single = load_gguf(embedded_model_path())
    for shard in shards:
        model = load_gguf(str(shard))
        assert model.hf_config == single.hf_config
        assert model.tensor_names() == single.tensor_names()
    files = read_gguf(str(shards[1]))
    assert files.paths == [str(p) for p in shards]
    # Each shard really holds only part of the tensors (the writer split them).
    assert all(0 < len(gguf.GGUFReader(p).tensors) < len(files.tensors) for p in shards)
    split = load_gguf(str(shards[0]))
    for name in single.tensor_names():
        a, b = split.raw_tensor(name), single.raw_tensor(name)
        assert a.qtype == b.qtype and a.shape == b.shape
        assert (a.data == b.data).all(), name


def test_tokenizer_from_a_later_shard(shards: list[Path]) -> None:
    text = "The capital of France is Paris."
    want = load_gguf_tokenizer(embedded_model_path()).encode(text)
    assert load_gguf_tokenizer(str(shards[2])).encode(text) == want


def test_split_model_answers_like_the_single_file(shards: list[Path]) -> None:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    got = LLM(str(shards[0]), max_model_len=256, num_kv_blocks=32).generate(prompts, params)
    want = LLM(embedded_model_path(), max_model_len=256, num_kv_blocks=32).generate(prompts,
                                                                                   params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) == 8 for o in got)


def test_missing_shard_is_named(shards: list[Path], tmp_path: Path) -> None:
    for shard in (shards[0], shards[2]):
        shutil.copy(shard, tmp_path / shard.name)
    missing = tmp_path / shards[1].name
    for given in (shards[0].name, shards[2].name):
        with pytest.raises(ValueError, match=f"{missing}.*is missing"):
            load_gguf(str(tmp_path / given))
    with pytest.raises(ValueError, match=shards[1].name):
        load_gguf_tokenizer(str(tmp_path / shards[0].name))
    from tokenmill import LLM

    with pytest.raises(ValueError, match=shards[1].name):
        LLM(str(tmp_path / shards[0].name), max_model_len=256, num_kv_blocks=32)


def test_misnumbered_shards_are_refused(shards: list[Path], tmp_path: Path) -> None:
    # Shards 2 and 3 swapped by name: each file's split.no disagrees with its name.
    shutil.copy(shards[0], tmp_path / shards[0].name)
    shutil.copy(shards[1], tmp_path / shards[2].name)
    shutil.copy(shards[2], tmp_path / shards[1].name)
    with pytest.raises(ValueError, match=r"split\.no=2 .*its name says 1 of 3"):
        load_gguf(str(tmp_path / shards[0].name))


def test_shard_renamed_off_the_pattern_is_refused(shards: list[Path], tmp_path: Path) -> None:
    lone = tmp_path / "renamed.gguf"
    shutil.copy(shards[0], lone)
    with pytest.raises(ValueError, match="not named NAME-0000N-of-00003.gguf"):
        load_gguf(str(lone))


def test_unsplit_file_reads_as_one_shard() -> None:
    files = read_gguf(embedded_model_path())
    assert files.paths == [embedded_model_path()]
    assert "split.count" not in files.fields


def test_info_and_roofline_read_every_shard(shards: list[Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.bench.roofline import decode_weight_bytes
    from tokenmill.cli import main

    assert decode_weight_bytes(str(shards[0])) == decode_weight_bytes(embedded_model_path())
    outs = []
    for model in (str(shards[0]), embedded_model_path()):
        assert main(["info", "--model", model, "--max-model-len", "256"]) == 0
        outs.append(capsys.readouterr().out)
    assert shards[0].name in outs[0]
    # The model's lines agree (the KV plan's line moves with the machine's free memory).
    labels = ("architecture", "parameters", "quantization", "weights in memory", "vocab size")
    facts = [[line for line in out.splitlines() if line.startswith(labels)] for out in outs]
    assert len(facts[0]) == len(labels) and facts[0] == facts[1]


def test_sizes_count_every_shard(shards: list[Path], tmp_path: Path) -> None:
    from tokenmill.server.models_dir import size_on_disk
    from tokenmill.server.ollama_routes import _file_size

    total = sum(p.stat().st_size for p in shards)
    for shard in shards:
        assert size_on_disk(str(shard)) == total
        assert _file_size(str(shard)) == total
    # A file merely named like a shard, alone, is its own size (and a plain file too).
    lone = tmp_path / shards[0].name
    shutil.copy(shards[0], lone)
    assert size_on_disk(str(lone)) == shards[0].stat().st_size
    assert size_on_disk(embedded_model_path()) == Path(embedded_model_path()).stat().st_size


def _shard(path: Path, no: int, count: int, total: int, names: list[str]) -> None:
    """A tiny hand-made shard: its split.* keys as given, one small tensor per name."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", no)
    writer.add_uint16("split.count", count)
    writer.add_int32("split.tensors.count", total)
    for name in names:
        writer.add_tensor(name, np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("second", "total", "error"), [
    (["b"], 3, r"split\.tensors\.count is 3 but its 2 shards hold 2 tensors"),
    (["a"], 2, r"tensor 'a' is in more than one shard \(again in .*m-00002-of-00002.gguf"),
])
def test_shards_that_do_not_add_up_are_refused(tmp_path: Path, second: list[str], total: int,
                                               error: str) -> None:
    _shard(tmp_path / "m-00001-of-00002.gguf", 0, 2, total, ["a"])
    _shard(tmp_path / "m-00002-of-00002.gguf", 1, 2, total, second)
    with pytest.raises(ValueError, match=error):
        read_gguf(str(tmp_path / "m-00002-of-00002.gguf"))


def test_first_shard_with_metadata_only(tmp_path: Path) -> None:
    paths = write_split_copy(embedded_model_path(), tmp_path, 2, metadata_only_first=True)
    assert len(paths) == 3 and not gguf.GGUFReader(paths[0]).tensors
    single = load_gguf(embedded_model_path())
    for shard in (paths[0], paths[2]):
        model = load_gguf(str(shard))
        assert model.hf_config == single.hf_config
        assert model.tensor_names() == single.tensor_names()
