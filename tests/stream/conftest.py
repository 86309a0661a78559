"""The stream tests' small engine (loaded once) and a real redis-server per test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from stream_helpers import ENGINE_KWARGS, RedisServer


@pytest.fixture(scope="session")
def small_llm():
    from tokenmill import LLM

    return LLM(**ENGINE_KWARGS)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    pytest.importorskip("redis", reason="the redis client is not installed (the test extra has it)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed and could not be: "
                    "`bash scripts/install.sh --test` installs it with apt-get where it can")
    server = RedisServer(str(tmp_path))
    yield server
    server.stop()
