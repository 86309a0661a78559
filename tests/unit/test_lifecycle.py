"""ModelManager without models: a second change to a name that is being changed is a 409, and
a failed load leaves the served model in place (the engine load is replaced by a fake)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from tokenmill.api.errors import APIError
from tokenmill.config import ServerConfig
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server import lifecycle
from tokenmill.server.lifecycle import LoadRequest, ModelManager
from tokenmill.server.state import ServedModel, ServerState


def test_a_second_change_to_a_busy_name_is_a_409(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_load(config: object) -> object:
        release.wait(10)
        raise ValueError("no such model file")

    monkeypatch.setattr(lifecycle, "load_engine_for_thread", slow_load)

    async def main() -> None:
        old = ServedModel("m", SimpleNamespace(num_seqs_in_flight=0))  # type: ignore[arg-type]
        state = ServerState(ServerConfig(), {"m": old}, PrometheusMetrics())
        manager = ModelManager(state, make_config=lambda spec: spec)  # type: ignore[arg-type]
        first = asyncio.ensure_future(manager.swap(LoadRequest("m", "v2", {})))
        for _ in range(200):
            if any(m.get("state") == "swapping" for m in manager.describe()):
                break
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as second:
            await manager.swap(LoadRequest("m", "v3", {}))
        assert second.value.status == 409 and second.value.code == "model_busy"
        with pytest.raises(APIError) as load:
            await manager.load(LoadRequest("m", "v3", {}))
        assert load.value.status == 409
        release.set()
        with pytest.raises(APIError) as failed:
            await first
        assert failed.value.status == 400 and "no such model file" in failed.value.message
        assert state.models["m"] is old  # the failed swap changed nothing
        assert [m["state"] for m in manager.describe()] == ["serving"]

    asyncio.run(main())
