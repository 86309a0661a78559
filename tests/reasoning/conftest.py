"""tests/reasoning: one server with the tiny thinking model and the embedded SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from thinking_model import Server, start_thinking_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server, with a default thinking budget of 4 tokens."""
    s = start_thinking_server(tmp_path_factory.mktemp("thinking"), "--max-thinking-tokens", "4")
    yield s
    assert s.stop() == 0, s.log()
