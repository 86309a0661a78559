"""The `tokenmill` command as people know such tools: --help without torch, --version, no
abbreviated options, quiet interactive commands, serve --help in groups with defaults, and
chat/generate/models list talking to a running server."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from tokenmill.cli import _log_level, build_parser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, start_server  # noqa: E402

# Runs the CLI in a fresh process and reports on stderr whether torch got imported.
PROBE = ("import sys\nfrom tokenmill.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
         "except SystemExit as e:\n    rc = e.code\n"
         "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(rc)\n")


def probe(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, *args], input=stdin, text=True,
                          capture_output=True, timeout=600)


def test_help_and_version_import_no_torch() -> None:
    for args in (["--help"], ["pull", "--help"], ["--version"]):
        proc = probe(*args)
        assert proc.returncode == 0, proc.stderr
        assert "torch imported: False" in proc.stderr, args
    assert probe("--version").stdout.strip() == f"tokenmill {version('tokenmill')}"
    listing = probe("--help").stdout
    for name in ("serve", "chat", "generate", "pull", "list", "rm", "models", "bench"):
        assert f"\n    {name} " in listing


def test_options_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["serve", "--admin", "k"], ["chat", "--max-tok", "3"],
                 ["models", "--admin", "k", "list"], ["bench", "latency", "--max-model", "9"]):
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args(argv)
        assert "error: " in capsys.readouterr().err


def test_serve_help_is_grouped_with_defaults() -> None:
    text = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"].format_help()
    titles = [line[:-1] for line in text.splitlines() if line and line[0] != " "
              and line.endswith(":")]
    # The five in this order right after the general options (others may follow).
    assert titles[1:6] == ["model", "engine", "server", "security", "operations"]
    sections = dict(zip(titles, text.split("\n\n")[-len(titles):], strict=True))
    assert "MODEL" in sections["model"] and "--revision" in sections["model"]
    assert "--port PORT" in sections["server"] and "(default: 8000)" in sections["server"]
    assert "--api-key" in sections["security"] and "--admin-key" in sections["security"]
    assert "--drain-timeout" in sections["operations"]
    assert "--max-num-seqs" in sections["engine"]


def _level(*argv: str) -> int:
    return _log_level(build_parser(list(argv)).parse_args(list(argv)))


def test_interactive_commands_are_quiet_unless_verbose() -> None:
    for argv in (["chat"], ["generate", "hi"], ["pull", "o/n"], ["list"], ["chat", "-q"]):
        assert _level(*argv) == logging.WARNING, argv
    for argv in (["chat", "-v"], ["-v", "generate", "hi"], ["serve"], ["bench", "latency"]):
        assert _level(*argv) == logging.INFO, argv
    assert _level("serve", "-q") == logging.WARNING


def test_every_command_parses_with_the_full_parser() -> None:
    full = build_parser()
    args = full.parse_args(["serve", "org/name:Q4_K_M", "--revision", "v1"])
    assert isinstance(args, argparse.Namespace) and args.model_path == "org/name:Q4_K_M"
    assert full.parse_args(["chat", "--url", "http://x:1"]).url == "http://x:1"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = start_server("--api-key", "secret", "--admin-key", "admin",
                          headers={"Authorization": "Bearer secret"})
    yield served
    served.stop()


def test_generate_url_streams_the_servers_answer(server: Server) -> None:
    proc = probe("generate", "The capital of France is", "--url", server.url, "--api-key",
                 "secret", "--max-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    direct = httpx.post(f"{server.url}/v1/completions", timeout=60,
                        headers={"Authorization": "Bearer secret"},
                        json={"model": server.model, "prompt": "The capital of France is",
                              "max_tokens": 6, "temperature": 0}).json()
    assert proc.stdout.rstrip("\n") == direct["choices"][0]["text"]
    assert f"1 request to {server.model}: " in proc.stderr and "6 tokens" in proc.stderr
    assert "[cut at max_tokens" in proc.stderr
    assert "torch imported: False" in proc.stderr


def test_chat_url_keeps_the_conversation(server: Server) -> None:
    proc = probe("chat", "--url", server.url, "--api-key", "secret", "--max-tokens", "4",
                 "--temperature", "0", stdin="Hello there\nName a color.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("(4 tokens") == 2
    assert "torch imported: False" in proc.stderr
    refused = probe("chat", "--url", server.url, stdin="Hello\n/exit\n")  # no API key
    assert "401" in refused.stderr


def test_models_list_without_the_admin_key(server: Server) -> None:
    proc = probe("models", "--url", server.url, "--api-key", "secret", "list")
    assert proc.returncode == 0, proc.stderr
    assert f'"id": "{server.model}"' in proc.stdout
    admin = probe("models", "--url", server.url, "--admin-key", "admin", "list")
    assert admin.returncode == 0 and '"state"' in admin.stdout
    load = probe("models", "--url", server.url, "load", "x", "y")
    assert load.returncode == 2 and "admin key" in load.stderr
