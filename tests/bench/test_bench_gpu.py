"""`bench gpu` runs end to end (on the CPU, at toy sizes): its result files hold what the
issue's targets need, and the roofline arithmetic adds up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.bench.gpu import copy_bandwidth, device_facts
from tokenmill.cli import main


def _run(tmp_path: Path, suite: str, *extra: str) -> dict:
    out = tmp_path / f"{suite}.json"
    rc = main(["bench", "gpu", "--suite", suite, "--model", "tiny-llama", "--device", "cpu",
               "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "256", "--result-file", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_decode_suite_reports_the_roofline(tmp_path: Path) -> None:
    r = _run(tmp_path, "decode", "--num-prompts", "2", "--input-len", "8", "--output-len", "12",
             "--copy-bytes", str(8 << 20))
    t = r["tokenmill"]
    assert t["roofline_tokens_per_s"] == pytest.approx(
        t["copy_bandwidth_gb_s"] * 1e9 / t["decode_read_bytes"])
    assert 0 < t["decode_read_bytes"] < t["weight_bytes"]  # the rotary tables are not read
    assert t["roofline_fraction"] == pytest.approx(
        t["decode_tokens_per_s"] / t["roofline_tokens_per_s"])
    assert (t["prompt_tokens"], t["output_tokens"]) == (8, 12)
    assert r["reference"]["sglang_llama31_8b_h100_bs1_tok_s"] == 158.0
    for key in ("torch", "triton", "cuda", "device"):
        assert key in r["device"]
    assert r["engine"]["config"]["model"]["load_format"] == "dummy"


def test_throughput_suite_counts_every_token(tmp_path: Path) -> None:
    r = _run(tmp_path, "nano-vllm", "--num-prompts", "5", "--input-len", "4:12",
             "--output-len", "3:9")
    t = r["tokenmill"]
    assert t["num_requests"] == 5
    assert 5 * 3 <= t["total_output_tokens"] <= 5 * 9
    assert r["workload"] == {"num_requests": 5, "input_len": "4:12", "output_len": "3:9",
                             "seed": 0}


def test_hf_batch_suite_runs_transformers_on_the_same_workload(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    r = _run(tmp_path, "hf-batch", "--num-prompts", "3", "--input-len", "6",
             "--output-len", "5")
    assert r["tokenmill"]["total_output_tokens"] == 15
    assert r["peer"]["total_output_tokens"] == 15
    assert r["speedup"] == pytest.approx(r["tokenmill"]["output_tokens_per_s"]
                                         / r["peer"]["output_tokens_per_s"])


def test_copy_bandwidth_and_facts_on_cpu() -> None:
    assert copy_bandwidth(torch.device("cpu"), 1 << 20, iters=3) > 0
    facts = device_facts(torch.device("cpu"))
    assert facts["device"] == "cpu" and facts["torch"] == torch.__version__


def test_the_command_names_the_variables_it_ran_with(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Experiments that are off by default are turned on by TOKENMILL_* variables: a result's
    command gives them, ready to run again."""
    monkeypatch.setenv("TOKENMILL_PDL", "0")
    r = _run(tmp_path, "decode", "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
             "--copy-bytes", str(1 << 20))
    words = r["command"].split()
    program = words.index("tokenmill")
    assert "TOKENMILL_PDL=0" in words[:program]
    assert all(w.startswith("TOKENMILL_") for w in words[:program])
