"""Schema fuzzing (schemathesis, bounded in time) and heavy bodies against the shared server:
no 5xx, no crash, and the same greedy answer afterwards (`tokenmill bench fuzz` runs longer)."""

from __future__ import annotations

import pytest
from server_harness import Server

from tokenmill.bench.fuzz import run_fuzz

pytest.importorskip("schemathesis")


@pytest.mark.slow
def test_fuzzing_finds_no_server_error(server: Server) -> None:
    result = run_fuzz(server.url, max_time=45, workers=1, seed=1, heavy_requests=4,
                      heavy_messages=20_000)
    print(result)
    assert result.requests > 50, result.schemathesis_summary
    assert result.server_errors == 0, (result.statuses, result.schemathesis_summary)
    assert result.schemathesis_exit == 0, result.schemathesis_summary
    # The heavy bodies are refused (too many messages), not served or crashed on.
    assert set(result.heavy_statuses) == {"400"}
    assert result.alive_after and result.same_answer_after
