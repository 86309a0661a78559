"""tests/anthropic: the Messages API through the official `anthropic` SDK, against a server
(with an API key) of the tiny thinking model and the embedded SmolLM2."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reasoning"))

from thinking_model import ANTHROPIC_KEY as KEY  # noqa: E402
from thinking_model import Server, start_thinking_server  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_thinking_server(tmp_path_factory.mktemp("anthropic"), "--api-key", KEY,
                              headers={"Authorization": f"Bearer {KEY}"})
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="session")
def client(server: Server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
