"""What the start log says: each model by name (the two embedded ones apart), and notices
about the machine once however many engines start."""

from __future__ import annotations

import logging

import pytest

from tokenmill.cli import build_parser
from tokenmill.metrics import economics
from tokenmill.server.launcher import model_label
from tokenmill.server.model_registry import ModelSpec, default_specs, engine_configs


def test_each_default_model_is_named(tmp_path) -> None:
    args = build_parser().parse_args(["serve"])
    chat, embed = engine_configs(args, default_specs(args))
    assert "SmolLM2-135M-Instruct" in model_label(chat)
    assert "all-MiniLM-L6-v2" in model_label(embed)
    assert model_label(chat) != model_label(embed)
    # A model with a path is its path.
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    named = engine_configs(args, [ModelSpec("x", str(path))])[0]
    assert model_label(named) == str(path)


def test_energy_notices_print_once(caplog: pytest.LogCaptureFixture) -> None:
    economics.notice.cache_clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.metrics.economics"):
        economics.EnergyMeter()
        economics.EnergyMeter()
    messages = [r.getMessage() for r in caplog.records]
    assert messages and len(messages) == len(set(messages)), messages
    # Another meter of the same process adds nothing.
    caplog.clear()
    economics.EnergyMeter()
    assert not caplog.records
