"""The shared server process for tests/server, started once per session and stopped here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import Server, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The shared server: no auth, up to 16 sequences per batch."""
    s = start_server("--max-num-seqs", "16", "--max-queue", "64")
    yield s
    code = s.stop()
    assert code == 0, s.log()
