"""`bench compare` without running anything heavy: the report, the skips, the CLI wiring."""

from __future__ import annotations

import ast
import copy

import pytest

from tokenmill.bench import compare
from tokenmill.bench.compare_report import markdown_report, plot, ratio
from tokenmill.cli import build_parser


def level(tput: float) -> dict:
    return {"output_throughput": tput, "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0,
            "median_itl_ms": 20.0, "p99_itl_ms": 40.0}


RESULT = {
    "hardware": {"cpu": "Test CPU", "cores": 2, "memory_gib": 8.0, "torch": "2.13.0"},
    "config": {"levels": [1, 4], "latency_input_len": 500, "output_len": 128, "batch_size": 4,
               "threads": 2, "model": "/m/model.gguf"},
    "command": "tokenmill bench compare",
    "systems": {
        "tokenmill": {"version": "0.1.0",
                      "latency": {"decode_tokens_per_s": 40.0, "prefill_tokens_per_s": 800.0,
                                  "ttft_ms": {"median": 625.0}, "peak_rss_mib": 500.0},
                      "batch": {"output_tokens_per_s": 300.0, "peak_rss_mib": 600.0},
                      "serve": {"levels": {"1": level(30.0), "4": level(90.0)},
                                "peak_rss_mib": 700.0}},
        "llama.cpp": {"version": "0.3",
                      "latency": {"decode_tokens_per_s": 80.0, "prefill_tokens_per_s": 1600.0,
                                  "ttft_ms": {"median": 312.5}, "peak_rss_mib": 250.0},
                      "serve": {"levels": {"1": level(60.0), "4": level(60.0)},
                                "peak_rss_mib": 300.0}},
        "transformers": {"skipped": "no peers environment"},
    },
}


def test_ratio() -> None:
    assert ratio(30.0, 60.0) == "0.50x"
    assert ratio(None, 1.0) is None and ratio(1.0, 0) is None and ratio(1.0, None) is None


def test_markdown_report_has_ratios_and_skips() -> None:
    md = markdown_report(RESULT)
    assert "Test CPU, 2 cores" in md
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
            if line.startswith("| ")}
    decode = rows["single-stream decode, 128 tokens (out tok/s)"]
    assert "40.0" in decode and "80.0" in decode and "0.50x" in decode
    top = next(v for k, v in rows.items() if k.startswith("4 concurrent streams"))
    assert "90.0" in top and "1.50x" in top
    assert "transformers: skipped (no peers environment)" in md
    assert "`tokenmill bench compare`" in md


def test_markdown_report_with_a_failed_system() -> None:
    result = copy.deepcopy(RESULT)
    result["systems"]["llama.cpp"] = {"error": "the server exited with 1\nlog..."}
    md = markdown_report(result)
    assert "llama.cpp: failed (the server exited with 1)" in md


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = plot(RESULT, str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_missing_peers_are_skipped_with_a_reason() -> None:
    assert compare.skip_reason("tokenmill", {}, "py") is None
    assert "setup_peers.sh" in compare.skip_reason("llama.cpp", {}, "/nope/python")
    versions = {"llama_cpp": None, "llama_cpp_error": "ModuleNotFoundError", "transformers": "5"}
    assert "llama_cpp is not importable" in compare.skip_reason("llama.cpp", versions, "py")
    assert compare.skip_reason("transformers", versions, "py") is None
    assert compare.peer_versions("/no/such/python") == {}


def test_peers_script_is_standalone() -> None:
    """It runs under the peers' Python, which need not have tokenmill."""
    with open(compare.PEERS_SCRIPT, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "tokenmill" for m in modules)


@pytest.mark.parametrize("argv", [
    ["bench", "serve", "--num-prompts", "3", "--goodput", "ttft:100"],
    ["bench", "throughput", "--num-prompts", "2", "--threads", "1"],
    ["bench", "latency", "--input-len", "500", "--num-iters", "2"],
    ["bench", "compare", "--systems", "tokenmill", "--concurrency", "1,2",
     "--tokenmill-args=--quantization int4"],
])
def test_cli_wires_every_bench_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.command == "bench" and args.bench_command == argv[1]
    assert callable(args.func)


def test_compare_rejects_unknown_systems(tmp_path) -> None:
    args = build_parser().parse_args(["bench", "compare", "--systems", "vllm",
                                      "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="vllm"):
        args.func(args)


def test_a_broken_perplexity_module_breaks_only_itself(monkeypatch) -> None:
    import sys
    import types

    # A half-written module: importable, but without the function.
    monkeypatch.setitem(sys.modules, "tokenmill.bench.perplexity",
                        types.ModuleType("tokenmill.bench.perplexity"))
    parser = build_parser()
    assert parser.parse_args(["serve"]).command == "serve"
    args = parser.parse_args(["bench", "perplexity"])
    with pytest.raises(ValueError, match="perplexity is unavailable"):
        args.func(args)


def test_llama_server_runs_with_one_slot_per_stream(monkeypatch) -> None:
    started: list[list[str]] = []
    envs: list[dict[str, str] | None] = []
    # As the tokenmill CLI leaves it: the passive policy chosen by tokenmill, not the user.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENMILL_DEFAULTED_OMP_WAIT_POLICY", "1")

    class FakeServer:
        base_url = "http://x"

        def peak_rss_mib(self) -> float:
            return 100.0 + len(started)

        def stop(self) -> int:
            return 0

    def fake_start(cmd: list[str], port: int, env: dict[str, str] | None = None) -> FakeServer:
        started.append(cmd)
        envs.append(env)
        return FakeServer()

    monkeypatch.setattr(compare, "start_server", fake_start)
    monkeypatch.setattr(compare, "load_level", lambda url, c, cfg, wl, min_tokens: level(c))
    cfg = compare.CompareConfig(model="/m.gguf", threads=2, peers_python="py",
                                levels=[1, 4, 32], serve_input_len=128, output_len=128,
                                llama_server="/bin/llama-server")
    out = compare.sweep_llama_server(cfg, None)  # type: ignore[arg-type]
    assert [cmd[cmd.index("--parallel") + 1] for cmd in started] == ["1", "4", "32"]
    # Each slot holds one request's 256 tokens (whole KV blocks), as tokenmill's cache does.
    assert [cmd[cmd.index("--ctx-size") + 1] for cmd in started] == ["256", "1024", "8192"]
    assert set(out["levels"]) == {"1", "4", "32"} and out["peak_rss_mib"] == 103.0
    # llama-server runs with its own OpenMP default, not tokenmill's passive policy.
    assert all(env is not None and "OMP_WAIT_POLICY" not in env for env in envs)
    result = copy.deepcopy(RESULT)
    result["systems"]["llama.cpp"]["serve"] = out
    assert "with -np = streams" in markdown_report(result)


def test_llama_cpu_flags_never_turn_on_amx(tmp_path) -> None:
    import subprocess

    script = compare.os.path.join(compare.os.path.dirname(compare.PEERS_SCRIPT), "..", "..",
                                  "benchmarks", "llama_cpu_flags.sh")

    def flags(cpu: str) -> str:
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n")
        return subprocess.run(["bash", script], env={"CPUINFO": str(info), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True).stdout
    amd = flags("fpu sse avx avx2 fma f16c bmi2")
    assert "-DGGML_NATIVE=OFF" in amd and "-DGGML_AVX2=ON" in amd and "-DGGML_AVX512=OFF" in amd
    intel = flags("avx avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")
    assert "-DGGML_AVX512=ON" in intel and "-DGGML_AVX512_VNNI=ON" in intel
    assert "-DGGML_AVX512_BF16=ON" in intel and "-DGGML_AMX_INT8=OFF" in intel
    assert "AMX_TILE=ON" not in intel and "AMX_INT8=ON" not in intel


def test_report_gives_each_decode_as_a_share_of_the_roofline() -> None:
    result = copy.deepcopy(RESULT)
    result["roofline"] = {"read_bandwidth_gb_s": 20.0, "weight_bytes_per_token": 100 * 2**20,
                          "roofline_tokens_per_s": 200.0}
    md = markdown_report(result)
    row = next(line for line in md.splitlines() if "% of the memory roofline" in line)
    assert "20.0 GB/s read / 100.0 MiB a token = 200 tok/s" in row
    assert "| 20.0 | 40.0 | 0.50x" in row  # 40 / 200 and 80 / 200 tok/s
    assert "% of the memory roofline" in markdown_report(RESULT)  # the row, without values
    result["roofline"]["read_bandwidth_1_thread_gb_s"] = 12.5
    row = next(line for line in markdown_report(result).splitlines()
               if "% of the memory roofline" in line)
    assert "= 200 tok/s; one thread reads 12.5 GB/s)" in row


def test_roofline_pieces() -> None:
    from tokenmill.bench.roofline import decode_weight_bytes, fraction, read_bandwidth
    from tokenmill.model_loader.gguf import embedded_model_path
    from tokenmill.model_loader.gguf_header import GGUFHeader

    path = embedded_model_path()
    tensors = GGUFHeader(path).tensors
    # SmolLM2 ties its head to the token embedding: a decode step reads every tensor once.
    assert "output.weight" not in {t.name for t in tensors}
    assert decode_weight_bytes(path) == sum(t.data.nbytes for t in tensors)
    assert read_bandwidth(1, nbytes=1 << 22, repeats=2) > 0
    assert fraction(50.0, {"roofline_tokens_per_s": 200.0}) == 0.25
    assert fraction(None, {"roofline_tokens_per_s": 200.0}) is None
    assert fraction(50.0, {}) is None


def test_an_untied_embedding_is_not_read_per_token(tmp_path) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf_files import write_gguf

    from tokenmill.bench.roofline import decode_weight_bytes

    f32 = np.ones((64, 32), dtype=np.float32)
    tensors = {"token_embd.weight": (f32, Q.F32), "blk.0.attn_q.weight": (f32[:32], Q.F32)}
    kw = {"hidden": 32, "ffn": 64, "heads": 4, "kv_heads": 4, "context_length": 64,
          "rms_eps": 1e-5}
    tied = tmp_path / "tied.gguf"
    write_gguf(tied, "llama", tensors, **kw)
    assert decode_weight_bytes(str(tied)) == (64 + 32) * 32 * 4
    untied = tmp_path / "untied.gguf"
    write_gguf(untied, "llama", {**tensors, "output.weight": (f32, Q.F32)}, **kw)
    assert decode_weight_bytes(str(untied)) == (32 + 64) * 32 * 4


def test_every_level_sends_its_own_prompts(monkeypatch) -> None:
    """A server kept up across the levels must not find a level's prompts in its prefix cache
    from the level before."""
    cfg = compare.CompareConfig(model="m.gguf", threads=2, peers_python="py", levels=[1, 4, 16])
    serve = [f"prompt {i}" for i in range(sum(compare.level_requests(cfg, c) for c in cfg.levels))]
    wl = compare.Workloads("lat.jsonl", "batch.jsonl", serve)  # type: ignore[arg-type]
    sent: dict[int, list] = {}
    monkeypatch.setattr(compare, "server_model", lambda url, headers: "m")
    monkeypatch.setattr(compare, "benchmark",
                        lambda spec, percentiles: sent.setdefault(spec.max_concurrency,
                                                                  spec.requests) and {})
    for c in cfg.levels:
        compare.load_level("http://x", c, cfg, wl, min_tokens=False)
    assert [len(sent[c]) for c in cfg.levels] == [4, 8, 32]
    assert sum(sent.values(), []) == serve  # consecutive slices, none shared


def test_peers_get_their_own_openmp_policy(monkeypatch) -> None:
    """tokenmill chooses the passive OpenMP policy for itself; a peer started by a benchmark
    runs with its own default, unless the user set a policy, which every process keeps."""
    from tokenmill.envs import foreign_environ

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENMILL_DEFAULTED_OMP_WAIT_POLICY", "1")
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    env = foreign_environ()
    assert "OMP_WAIT_POLICY" not in env and "TOKENMILL_DEFAULTED_OMP_WAIT_POLICY" not in env
    assert env["SOMETHING_ELSE"] == "kept"
    monkeypatch.delenv("TOKENMILL_DEFAULTED_OMP_WAIT_POLICY")  # the user's own choice
    assert foreign_environ()["OMP_WAIT_POLICY"] == "PASSIVE"
