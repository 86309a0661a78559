"""The stand-in hub on a free port, serving the repos of hub_repos.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hub_repos import byte_repos
from stand_in_hub import StandInHub, serve_hub


@pytest.fixture(scope="module")
def stand_in_hub(smollm_path: str) -> Iterator[tuple[str, StandInHub]]:
    """(endpoint, hub) serving ``byte_repos``."""
    with serve_hub(byte_repos(smollm_path)) as served:
        yield served
