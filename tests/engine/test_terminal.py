"""`tokenmill generate` and `tokenmill chat` as a user runs them (stdin through a pipe, on the
embedded model): slash-commands stay local, a cut answer is marked, each answer says its speed,
generate ends with a summary."""

from __future__ import annotations

import subprocess
import sys

CHAT_INPUT = "/help\n/bogus\nHello there\n/system You are terse.\nName a color.\n/exit\nnot sent\n"


def run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], input=stdin, text=True,
                          capture_output=True, timeout=600)


def test_chat_commands_stay_local_and_answers_report_themselves() -> None:
    proc = run(["chat", "-q", "--max-tokens", "4", "--temperature", "0"], CHAT_INPUT)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "/system TEXT" in err  # /help printed the command list
    assert "unknown command /bogus" in err
    assert "(system message set; conversation cleared)" in err
    # Two messages went to the model, each answer cut at 4 tokens and measured.
    assert err.count("[cut at max_tokens") == 2
    assert err.count("(4 tokens, ") == 2 and "tokens/s" in err
    # Two answers on stdout (one line each), and nothing after /exit.
    answers = [line for line in proc.stdout.split("> ") if line.strip()]
    assert len(answers) == 2


def test_generate_prints_a_summary() -> None:
    proc = run(["generate", "The capital of France is", "--max-tokens", "6",
                "--temperature", "0", "-q"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("1 request: ") and "6 tokens" in summary
    assert "prompt" in summary and "tokens/s" in summary and "s in all" in summary
    assert "[cut at max_tokens" in proc.stderr
