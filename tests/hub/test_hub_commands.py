"""Models by name end to end, against the stand-in hub through HF_ENDPOINT with a temporary
HF_HOME: `tokenmill pull|list|rm`, `tokenmill serve ORG/NAME` answering a chat, and
`LLM("ORG/NAME")`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_repos import GATED_REPO, GATED_TOKEN, GGUF_REPO, byte_repos, gguf_repo
from stand_in_hub import Repo, commit_id, serve_hub

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS / "server"))
sys.path.insert(0, str(TESTS / "models"))

from hf_checkpoints import COMMON, randomize, write_tokenizer  # noqa: E402
from server_harness import start_server  # noqa: E402

LLAMA_REPO = "tokenmill-test/tiny-llama"
# Enough of a chat template for the word-level tokenizer ("t0".."t255").
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama folder with a word-level tokenizer and a chat template."""
    import torch  # noqa: F401  (transformers needs it; imported here, not at collection)

    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2))
    randomize(model, seed=3)
    model.save_pretrained(path)
    write_tokenizer(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> Iterator[dict]:
    """The environment of a process that uses the stand-in hub and a fresh HF_HOME."""
    folder = tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    files: dict[str, bytes | str] = {p.name: str(p) for p in folder.iterdir()}
    repos = {GGUF_REPO: gguf_repo(smollm_path), GATED_REPO: byte_repos(smollm_path)[GATED_REPO],
             LLAMA_REPO: Repo(commits={commit_id("llama"): files},
                              refs={"main": commit_id("llama")})}
    with serve_hub(repos) as (endpoint, _):
        home = tmp_path_factory.mktemp("hf-home")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        yield {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home),
               "HF_HUB_DISABLE_TELEMETRY": "1"}


def tokenmill(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], env=env, text=True,
                          capture_output=True, timeout=600)


def test_pull_list_rm(hub_env: dict) -> None:
    pulled = tokenmill(hub_env, "pull", f"{GGUF_REPO}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    path = pulled.stdout.strip()
    assert path.startswith(hub_env["HF_HOME"]) and Path(path).read_bytes() == b"q8-main" * 1000
    missing = tokenmill(hub_env, "pull", f"{GGUF_REPO}:Q5_K_M")
    assert missing.returncode == 2
    assert "has no Q5_K_M GGUF file; it has: Q2_K, Q4_1, Q8_0" in missing.stderr
    listed = tokenmill(hub_env, "list")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if GGUF_REPO in line)
    assert "main" in row and "gguf Q8_0" in row and "7.0 KB" in row
    assert tokenmill(hub_env, "rm", GGUF_REPO).stdout.startswith(f"removed {GGUF_REPO}")
    assert not Path(path).exists()
    assert "no models in the cache" in tokenmill(hub_env, "list").stdout
    gone = tokenmill(hub_env, "rm", GGUF_REPO)
    assert gone.returncode == 2 and "not in the cache" in gone.stderr


def test_a_gated_repo_wants_hf_token(hub_env: dict) -> None:
    refused = tokenmill(hub_env, "pull", GATED_REPO)
    assert refused.returncode == 2
    assert "gated repo: accept its conditions" in refused.stderr and "HF_TOKEN" in refused.stderr
    pulled = tokenmill({**hub_env, "HF_TOKEN": GATED_TOKEN}, "pull", GATED_REPO)
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).read_bytes() == b"gated"


def test_serve_by_name_answers_a_chat(hub_env: dict) -> None:
    server = start_server(LLAMA_REPO, "--max-model-len", "256", env=hub_env)
    try:
        assert server.model == LLAMA_REPO  # served under the repo's name, as vLLM does
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": LLAMA_REPO, "messages": [{"role": "user", "content": "t5 t9 t13"}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0
    # Then without network: the cache serves it (HF_HUB_OFFLINE never asks the hub).
    server = start_server(LLAMA_REPO, "--max-model-len", "256",
                          env={**hub_env, "HF_HUB_OFFLINE": "1"})
    try:
        assert server.model == LLAMA_REPO
    finally:
        server.stop()


def test_llm_takes_a_repo_name(hub_env: dict) -> None:
    code = ("from tokenmill import LLM, SamplingParams\n"
            f"llm = LLM({LLAMA_REPO!r}, kv_cache_memory_bytes=1 << 24)\n"
            "out = llm.generate('t5 t9', SamplingParams(max_tokens=3, temperature=0))\n"
            "print(len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=hub_env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3"
    unknown = subprocess.run([sys.executable, "-c", "from tokenmill import LLM\n"
                              "LLM('tokenmill-test/no-such-model')"], env=hub_env, text=True,
                             capture_output=True, timeout=600)
    assert "no repo tokenmill-test/no-such-model on http://127.0.0.1:" in unknown.stderr


def test_generate_offline_without_network_says_how(hub_env: dict) -> None:
    env = {**hub_env, "HF_HUB_OFFLINE": "1"}
    proc = tokenmill(env, "generate", "hi", "--model", f"{GGUF_REPO}:Q2_K")
    assert proc.returncode == 2
    assert "HF_HUB_OFFLINE is set" in proc.stderr and "tokenmill pull" in proc.stderr
