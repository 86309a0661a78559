"""The command line as users type it: global options after the command too, and
`tokenmill serve MODEL` like `vllm serve MODEL`."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.cli import build_parser, cmd_serve


@pytest.mark.parametrize("argv", [
    ["-q", "chat"], ["chat", "-q"], ["chat", "--quiet"], ["generate", "hi", "-q"],
    ["bench", "serve", "-q", "--num-prompts", "3"], ["monitor", "save-reference", "-o", "x", "-q"],
])
def test_quiet_anywhere(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).quiet is True


def test_not_quiet_by_default() -> None:
    assert build_parser().parse_args(["chat"]).quiet is False
    assert build_parser().parse_args(["bench", "latency"]).quiet is False


def test_serve_takes_the_model_as_an_argument() -> None:
    args = build_parser().parse_args(["serve", "models/m.gguf", "--port", "9000"])
    assert args.model_path == "models/m.gguf" and args.model is None
    assert build_parser().parse_args(["serve"]).model_path is None


def test_serve_refuses_the_model_twice() -> None:
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(ValueError, match="given twice"):
        cmd_serve(args)


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_option_has_a_help_line_and_says_its_default() -> None:
    options = list(_options(build_parser()))
    assert len(options) > 300
    no_help = [f"{cmd} {a.option_strings[-1]}" for cmd, a in options if not a.help]
    assert no_help == []
    # A value with a default says it (flags and options without a default have none to say).
    hidden = [f"{cmd} {a.option_strings[-1]}" for cmd, a in options
              if a.default not in (None, False, True, argparse.SUPPRESS)
              and "default" not in a.help]
    assert hidden == []
