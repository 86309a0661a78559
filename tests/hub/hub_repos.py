"""The stand-in hub's repos: a GGUF repo (the embedded model and small stand-ins for other
quantizations, a split file, an older tag), a Hugging Face folder, a gated repo. A module of
its own name (not conftest) so that test modules import it the same way whichever other
folders' conftest files pytest loaded first."""

from __future__ import annotations

from stand_in_hub import Repo, commit_id

GGUF_REPO = "tokenmill-test/SmolLM2-135M-Instruct-GGUF"
FOLDER_REPO = "tokenmill-test/tiny-folder"
GATED_REPO = "tokenmill-test/gated-GGUF"
GATED_TOKEN = "hf_stand_in_token"
Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_repo(embedded: str) -> Repo:
    """The embedded GGUF as Q4_1, byte stand-ins for Q8_0 and a split Q2_K, and a tag v1
    whose Q8_0 differs."""
    main, old = commit_id("gguf-main"), commit_id("gguf-v1")
    return Repo(commits={
        main: {Q4_1: embedded, "SmolLM2-135M-Instruct.Q8_0.gguf": b"q8-main" * 1000,
               "Q2_K/SmolLM2-Q2_K-00001-of-00002.gguf": b"shard-1",
               "Q2_K/SmolLM2-Q2_K-00002-of-00002.gguf": b"shard-2",
               "README.md": b"# a GGUF repo"},
        old: {"SmolLM2-135M-Instruct.Q8_0.gguf": b"q8-v1"},
    }, refs={"main": main, "v1": old})


def byte_repos(embedded: str) -> dict[str, Repo]:
    """Every repo, with a folder of byte stand-ins (for the file choice, never loaded)."""
    folder = {"config.json": b"{}", "model.safetensors": b"weights", "tokenizer.json": b"{}",
              "chat_template.jinja": b"{{ messages }}", "pytorch_model.bin": b"other format",
              "1_Pooling/config.json": b"{}"}
    return {
        GGUF_REPO: gguf_repo(embedded),
        FOLDER_REPO: Repo(commits={commit_id("folder"): folder},
                          refs={"main": commit_id("folder")}),
        GATED_REPO: Repo(commits={commit_id("gated"): {"m-Q8_0.gguf": b"gated"}},
                         refs={"main": commit_id("gated")}, gated_token=GATED_TOKEN),
    }
