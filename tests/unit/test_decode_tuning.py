"""The decode attention's per-GPU launch settings: the tuning file, its errors, the lookup by
device, and the sweep script that writes it (in Triton's interpreter on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.kernels.tuning import decode_attention as dt
from tokenmill.kernels.tuning.decode_attention import DecodeLaunch, DecodeTuning

ROOT = Path(__file__).parents[2]


def write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(autouse=True)
def _fresh_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dt.ENV_FILE, raising=False)
    dt.tuning_for_device.cache_clear()
    yield
    dt.tuning_for_device.cache_clear()


def test_rules_apply_by_batch_size(tmp_path: Path) -> None:
    tuning = dt.load_tuning(write(tmp_path / "t.json", {"by_batch": [
        {"max_batch": 8, "partition_size": 128, "block_n": 16, "num_warps": 4,
         "num_stages": 2, "total_ms": 1.5},  # extra keys (the sweep's figures) are ignored
        {"max_batch": 64, "partition_size": 256},
        {"max_batch": None, "partition_size": 1024, "block_n": 64, "num_warps": 4}]}))
    assert tuning.for_batch(1) == DecodeLaunch(128, 16, 4, 2)
    assert tuning.for_batch(8) == DecodeLaunch(128, 16, 4, 2)
    assert tuning.for_batch(9) == DecodeLaunch(256, 32, 8, None)
    assert tuning.for_batch(65) == tuning.for_batch(4096) == DecodeLaunch(1024, 64, 4, None)
    assert tuning.for_batch(1).kwargs() == {"partition_size": 128, "block_n": 16,
                                            "num_warps": 4, "num_stages": 2,
                                            "fp8_compute": "fp16", "max_registers": None,
                                            "preload_table": False}
    # Without rules of its own, an fp8 cache takes the same ones.
    assert tuning.for_batch(9, fp8_cache=True) == tuning.for_batch(9)
    # Without a rule for every batch, larger batches take the defaults.
    capped = dt.parse_tuning({"by_batch": [{"max_batch": 4, "block_n": 64}]}, "x")
    assert capped.for_batch(5) == dt.DEFAULT_LAUNCH
    assert DecodeTuning().for_batch(300) == dt.DEFAULT_LAUNCH


def test_rules_by_longest_context_and_their_classes() -> None:
    """Rules may also bound the step's longest context; ``context_classes`` lists where a
    batch size's launch changes, so that a graph per class serves every step."""
    tuning = dt.parse_tuning({"by_batch": [
        {"max_batch": 8, "max_context": 512, "partition_size": 64},
        {"max_batch": 8, "partition_size": 128},
        {"max_context": 1024, "partition_size": 256},
        {"max_context": 4096, "block_n": 64},
        {"partition_size": 1024}]}, "t")
    assert tuning.for_batch(8, context=512) == DecodeLaunch(64)
    assert tuning.for_batch(8, context=513) == tuning.for_batch(8) == DecodeLaunch(128)
    assert tuning.for_batch(9, context=100) == DecodeLaunch(256)
    assert tuning.for_batch(9, context=2000) == DecodeLaunch(block_n=64)
    # An unknown context takes a rule for any context.
    assert tuning.for_batch(9) == tuning.for_batch(9, context=5000) == DecodeLaunch(1024)
    assert tuning.context_classes(4) == (512, None)
    assert tuning.context_classes(9) == (1024, 4096, None)
    assert tuning.context_classes(9, fp8_cache=True) == (1024, 4096, None)
    # Each class launches what a step of any context inside it gets.
    for batch in (4, 9):
        classes = tuning.context_classes(batch)
        for context in (1, 300, 512, 513, 1024, 1025, 4096, 4097, 9000):
            cls = next(c for c in classes if c is None or context <= c)
            assert tuning.for_batch(batch, context=cls) == tuning.for_batch(batch,
                                                                            context=context)
    assert DecodeTuning().context_classes(7) == (None,)


def test_an_fp8_cache_takes_its_own_rules(tmp_path: Path) -> None:
    """``by_batch_fp8`` (written by ``attention_bw.py --kv-cache-dtype fp8``) serves fp8
    caches only, with its own batch classes and widening."""
    tuning = dt.load_tuning(write(tmp_path / "t.json", {
        "by_batch": [{"max_batch": 8, "partition_size": 128}, {"max_batch": None}],
        "by_batch_fp8": [{"max_batch": None, "partition_size": 1024, "block_n": 128,
                          "num_warps": 8, "fp8_compute": "query"}]}))
    assert tuning.for_batch(4) == DecodeLaunch(128)
    assert tuning.for_batch(300) == dt.DEFAULT_LAUNCH
    for batch in (1, 4, 300):
        assert tuning.for_batch(batch, fp8_cache=True) == DecodeLaunch(1024, 128, 8, None,
                                                                       "query")


@pytest.mark.parametrize("data,message", [
    ([], "non-empty list 'by_batch'"),
    ({"by_batch": []}, "non-empty list 'by_batch'"),
    ({"by_batch": ["x"]}, r"by_batch\[0\] must be an object"),
    ({"by_batch": [{"partition_size": 100}]}, r"by_batch\[0\]: partition_size must be a power"),
    ({"by_batch": [{"block_n": 8}]}, r"by_batch\[0\]: block_n must be a power of two >= 16"),
    ({"by_batch": [{"num_warps": 3}]}, "num_warps must be 1, 2, 4, 8 or 16, got 3"),
    ({"by_batch": [{"num_stages": 0}]}, "num_stages must be null or 1..8"),
    ({"by_batch": [{"max_batch": 8}, {"max_batch": 8}]},
     r"by_batch\[1\] is never used: by_batch\[0\] comes first and matches every step"),
    ({"by_batch": [{"max_batch": "8"}]}, "max_batch must be null or a positive integer"),
    ({"by_batch": [{"max_context": 0}]}, "max_context must be null or a positive integer"),
    ({"by_batch": [{"max_batch": None}, {"max_batch": None}]},
     r"by_batch\[1\] is never used: by_batch\[0\]"),
    ({"by_batch": [{"max_context": 1024}, {"max_context": 512}]},
     r"by_batch\[1\] is never used: by_batch\[0\]"),
    ({"by_batch": [{"max_registers": 300}]}, r"by_batch\[0\]: max_registers must be null or 24..255"),
    ({"by_batch": [{"preload_table": 1}]}, r"by_batch\[0\]: preload_table must be true or false"),
    ({"by_batch": [{"fp8_compute": "fp32"}]},
     r"by_batch\[0\]: fp8_compute must be one of fp16, query, got 'fp32'"),
    ({"by_batch": [{}], "by_batch_fp8": []}, r"by_batch_fp8: expected a non-empty list"),
    ({"by_batch": [{}], "by_batch_fp8": [{"block_n": 12}]},
     r"by_batch_fp8\[0\]: block_n must be a power of two"),
])
def test_bad_files_name_the_file_and_the_entry(tmp_path: Path, data: object,
                                                message: str) -> None:
    path = write(tmp_path / "bad.json", data)
    with pytest.raises(ValueError, match=message) as e:
        dt.load_tuning(path)
    assert str(path) in str(e.value)


def test_a_file_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{by_batch")
    with pytest.raises(ValueError, match="not JSON"):
        dt.load_tuning(path)


def test_lookup_by_device_env_file_then_defaults(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert dt.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert dt.device_slug("NVIDIA H200") == "nvidia-h200"
    monkeypatch.setattr(dt, "TUNED_DIR", tmp_path)
    write(tmp_path / "nvidia-h200.json", {"by_batch": [{"partition_size": 64}]})
    assert dt.tuning_for_device("NVIDIA H200").for_batch(1).partition_size == 64
    assert dt.tuning_for_device("NVIDIA H200").source == str(tmp_path / "nvidia-h200.json")
    assert dt.tuning_for_device("NVIDIA A100-SXM4-80GB") == DecodeTuning()
    dt.tuning_for_device.cache_clear()
    env = write(tmp_path / "mine.json", {"by_batch": [{"partition_size": 1024}]})
    monkeypatch.setenv(dt.ENV_FILE, str(env))
    assert dt.tuning_for_device("NVIDIA H200").for_batch(1).partition_size == 1024
    dt.tuning_for_device.cache_clear()
    monkeypatch.setenv(dt.ENV_FILE, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"\$TOKENMILL_DECODE_TUNING=.*missing.json: no such file"):
        dt.tuning_for_device("NVIDIA H200")


def test_packaged_tuning_files_parse() -> None:
    """Every file shipped for a GPU loads (the compile test builds their launches too)."""
    for path in sorted(dt.TUNED_DIR.glob("*.json")):
        tuning = dt.load_tuning(path)
        assert tuning.rules and tuning.rules[-1].max_batch is None, path
        assert dt.device_slug(json.loads(path.read_text())["device"]) == path.stem


@pytest.mark.slow
def test_sweep_script_writes_a_tuning_file(tmp_path: Path) -> None:
    """attention_bw.py in the interpreter (no timings there): every variant computed and
    compared with the default, one rule per batch class, a file the engine can load."""
    env = {k: v for k, v in os.environ.items() if k != dt.ENV_FILE}
    out, result = tmp_path / "tuning.json", tmp_path / "sweep.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/attention_bw.py"), "--shapes", "2x40,9x20",
         "--write-tuning", str(out), "--result-file", str(result)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tuning = dt.load_tuning(out)
    assert [r.max_batch for r in tuning.rules] == [8, None]
    rows = json.loads(result.read_text())["results"]
    # Two shapes x (the default, two other grid points, then the winner at four depths, its
    # block ids read in the loop and before it).
    assert len(rows) == 22 and all("error" not in r for r in rows)
    assert {r["num_stages"] for r in rows} == {None, 1, 2, 3, 4}
    assert {r["preload_table"] for r in rows} == {False, True}
    assert max(r["rel_err_vs_default"] for r in rows) < 1e-4
    # An fp8 sweep adds its rules to the same file and keeps the others.
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/attention_bw.py"), "--shapes", "9x20",
         "--kv-cache-dtype", "fp8", "--write-tuning", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = dt.load_tuning(out)
    assert merged.rules == tuning.rules
    assert [r.max_batch for r in merged.fp8_rules] == [None]
    # Context classes: with --context-split the larger batches' short and long contexts are
    # classes of their own, each a rule unless its settings equal the next one's (in the
    # interpreter nothing is timed, so every class keeps the defaults and they fold into one).
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/attention_bw.py"), "--shapes",
         "2x40,9x20,9x40", "--context-split", "30", "--write-tuning", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "large, contexts <= 30 (9x20)" in done.stdout
    assert "large, contexts > 30 (9x40)" in done.stdout
    split = dt.load_tuning(out)
    assert [(r.max_batch, r.max_context) for r in split.rules] == [(8, None), (None, None)]
