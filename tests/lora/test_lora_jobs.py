"""LoRA adapters in the jobs: in `tokenmill batch` a line whose body names an adapter as its
model runs with it and is answered under its name, in `tokenmill stream` a record whose
`model` field names one; the others run the base model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lora_helpers import PROMPTS, Base, lora_request

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import run_batch

GREEDY_PARAMS = SamplingParams(temperature=0, max_tokens=8)


def _words(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


def _line(custom_id: str, model: str, prompt: int, url: str = "/v1/completions") -> str:
    body = {"model": model, "prompt": " ".join(_words(PROMPTS[prompt])), "max_tokens": 8,
            "temperature": 0}
    if url == "/v1/embeddings":
        body = {"model": model, "input": "t5 t6"}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_lines_run_their_adapters(lora_base: Base, adapters: dict[str, Path],
                                  references: dict[str | None, list[list[int]]],
                                  tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    lines = [_line("qv", "qv", 0), _line("base", "tiny", 0), _line("all", "all", 2),
             _line("qv2", "qv", 2), _line("emb", "qv", 0, "/v1/embeddings")]
    source.write_text("\n".join(lines) + "\n")
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=2)
    try:
        loras = {name: lora_request(adapters, name) for name in ("qv", "all")}
        stats = run_batch(str(source), str(tmp_path / "out.jsonl"), llm, progress=False,
                          model_name="tiny", adapters=loras)
    finally:
        llm.close()
    results = {r["custom_id"]: r for r in map(json.loads,
                                              (tmp_path / "out.jsonl").read_text().splitlines())}
    for custom_id, name, prompt in (("qv", "qv", 0), ("base", None, 0), ("all", "all", 2),
                                    ("qv2", "qv", 2)):
        body = results[custom_id]["response"]["body"]
        assert body["model"] == (name or "tiny")
        assert body["choices"][0]["text"].split() == _words(references[name][prompt])
    refused = results["emb"]["response"]  # as the endpoint would answer: a 400 body
    assert refused["status_code"] == 400
    assert "'qv' is a LoRA adapter: adapters apply to chat and completions" in \
        refused["body"]["error"]["message"]
    assert (stats.succeeded, stats.failed) == (4, 1)


def test_command_line(lora_base: Base, adapters: dict[str, Path],
                      references: dict[str | None, list[list[int]]], tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(_line("x", "mine", 1) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tokenmill", "-q", "batch", "--no-progress", "-i", str(source),
           "-o", str(out), "--model", str(lora_base.path), "--dtype", "float32",
           "--threads", "1", "--lora-modules", f"mine={adapters['mlp']}"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--lora-modules needs --enable-lora" in refused.stderr
    subprocess.run([*cmd, "--enable-lora"], check=True, capture_output=True, timeout=300)
    body = json.loads(out.read_text())["response"]["body"]
    assert body["model"] == "mine"
    assert body["choices"][0]["text"].split() == _words(references["mlp"][1])


def test_stream_records_run_their_adapters(lora_base: Base, adapters: dict[str, Path],
                                           references: dict[str | None, list[list[int]]]
                                           ) -> None:
    """`tokenmill stream`: a record's `model` field picks its adapter; no field: the base
    model; a name no adapter has: that record's error, and the stream goes on."""
    from tokenmill.stream import PromptTemplate, Record, StreamResult, StreamRunner

    class Source:
        def __init__(self, records: list[Record]) -> None:
            self.records, self.exhausted, self.acked = records, False, []

        def read(self, max_records: int, timeout: float) -> list[Record]:
            out, self.records = self.records[:max_records], self.records[max_records:]
            self.exhausted = not self.records
            return out

        def ack(self, records: list[Record]) -> None:
            self.acked += records

    class Sink:
        def __init__(self) -> None:
            self.results: dict[str, StreamResult] = {}

        def write(self, results: list[tuple[Record, str]]) -> None:
            for record, line in results:
                self.results[record.id] = StreamResult.model_validate_json(line)

    text = " ".join(_words(PROMPTS[0]))
    records = [Record("qv", {"text": text, "model": "qv"}, 0.0),
               Record("base", {"text": text}, 0.0),
               Record("all", {"text": text, "model": "all"}, 0.0),
               Record("nope", {"text": text, "model": "nope"}, 0.0)]
    source, sink = Source(records), Sink()
    llm = LLM(str(lora_base.path), dtype="float32", enable_lora=True, max_loras=2)
    try:
        StreamRunner(llm.engine, source, sink, PromptTemplate("{text}"),
                     GREEDY_PARAMS, adapters={n: lora_request(adapters, n) for n in ("qv", "all")}
                     ).run()
    finally:
        llm.close()
    for rid, name in (("qv", "qv"), ("base", None), ("all", "all")):
        assert sink.results[rid].text.split() == _words(references[name][0]), rid
    assert "field 'model' is 'nope', which names no LoRA adapter ('qv', 'all')" in \
        sink.results["nope"].error
    assert len(source.acked) == 4
