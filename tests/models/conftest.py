"""Session fixtures: each family's tiny HF checkpoint, written and loaded once."""

from __future__ import annotations

import pytest
from hf_checkpoints import FAMILIES, Checkpoint, make_checkpoint


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Each family's checkpoint in turn."""
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The GQA Llama-3-rope checkpoint on its own, for the batching tests."""
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama_only"))
