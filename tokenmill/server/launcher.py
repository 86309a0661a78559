"""Run the server: load the engine, serve with uvicorn, drain on SIGTERM, exit on engine death.

Exit codes: 0 after a SIGTERM / Ctrl-C shutdown (requests in flight drain for up to
``drain_timeout`` seconds, then the rest end with finish_reason "abort"); 1 when an engine step
raised: the requests in flight fail with a 500 or an error event, /health turns 503, and after
``FAULT_EXIT_GRACE_S`` seconds (to deliver those errors) the process exits so that a supervisor
can restart it on a clean engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
from types import FrameType

import uvicorn

from tokenmill.api.validation import default_model_name
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_llm import AsyncLLM, load_engine_for_thread
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.server.app import build_app
from tokenmill.server.connections import GuardedH11Protocol
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)

# Seconds between an engine failure and the process exit: errors reach clients, probes see 503.
FAULT_EXIT_GRACE_S = 2.0
# Seconds uvicorn waits for open connections after the drain before cancelling them.
CONNECTION_CLOSE_TIMEOUT_S = 5


class _Server(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM / SIGINT and a force-quit on the
    second, and an exit code that reports an engine failure."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self._spawn(self._watch_engine())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and the process
        # would die by the signal instead of returning our exit code.
        if self.state.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._spawn, self._drain())

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        client, timeout = self.state.client, self.state.config.drain_timeout
        logger.info("waiting up to %.0f s for %d sequences in flight", timeout,
                    client.num_seqs_in_flight)
        if not await client.wait_idle(timeout):
            logger.warning("drain timeout: aborting %d sequences", client.num_seqs_in_flight)
            client.abort_all()
            await client.wait_idle(CONNECTION_CLOSE_TIMEOUT_S)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        dead = self.state.client.dead
        assert dead is not None
        await dead.wait()
        logger.error("%s; exiting in %.0f s", self.state.client.dead_reason, FAULT_EXIT_GRACE_S)
        await asyncio.sleep(FAULT_EXIT_GRACE_S)
        self.exit_code = 1
        self.should_exit = True


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGTERM (exit code 0) or an engine failure (exit code 1)."""
    # The model loads before the port opens: anything that answers is ready to serve.
    # Not in this thread: see load_engine_for_thread.
    engine = load_engine_for_thread(engine_config)
    if config.served_model_name is None:
        config = dataclasses.replace(config,
                                     served_model_name=default_model_name(engine.model_path))
    metrics = PrometheusStatLogger(config.served_model_name or "default")
    client = AsyncLLM(engine, max_queue=config.max_queue, stat_loggers=[metrics],
                      debug_fail_at_step=config.debug_fail_at_step)
    state = ServerState(config, client, metrics)
    if config.debug_fail_at_step is not None:
        logger.warning("fault injection is on: engine step %d will raise",
                       config.debug_fail_at_step)
    uv_config = uvicorn.Config(
        build_app(state), host=config.host, port=config.port, log_level="info",
        timeout_graceful_shutdown=CONNECTION_CLOSE_TIMEOUT_S, lifespan="on",
        http=GuardedH11Protocol.configured(config.header_timeout, config.max_connections))
    server = _Server(uv_config, state)
    logger.info("serving %r on http://%s:%d/v1 (auth %s)", state.model_name, config.host,
                config.port, "on" if config.api_key else "off")
    server.run()
    return server.exit_code
