"""The small engine that the batch tests share (loaded once per session)."""

from __future__ import annotations

import pytest
from batch_helpers import ENGINE_KWARGS


@pytest.fixture(scope="session")
def small_llm():
    from tokenmill import LLM

    return LLM(**ENGINE_KWARGS)
