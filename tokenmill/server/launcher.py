"""Run the server: load the engine, serve with uvicorn, drain on SIGTERM, exit on engine death.

Exit codes: 0 after a SIGTERM / Ctrl-C shutdown (requests in flight drain for up to
``drain_timeout`` seconds, then the rest end with finish_reason "abort"); 1 when an engine step
raised: the requests in flight fail with a 500 or an error event, /health turns 503, and after
``FAULT_EXIT_GRACE_S`` seconds (to deliver those errors) the process exits so that a supervisor
can restart it on a clean engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn

from tokenmill.api.validation import default_model_name
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_llm import load_engine_for_thread
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.connections import GuardedH11Protocol
from tokenmill.server.lifecycle import ModelManager, serve_engine
from tokenmill.server.lora_adapters import LoRAModule, check_lora_options, load_lora_modules
from tokenmill.server.model_registry import ModelFactory, ModelSpec
from tokenmill.server.monitoring import make_monitors, prompt_embedder
from tokenmill.server.retrieval_setup import build_retrieval
from tokenmill.server.state import EMBED, ServerState
from tokenmill.tenancy.retention import TenancySettings
from tokenmill.utils import freeze_startup_heap, process_age_s

logger = logging.getLogger(__name__)

# What a config without a model path runs, by task (the packages the model loader reads).
EMBEDDED_MODELS = {"generate": "the embedded SmolLM2-135M-Instruct (chat)",
                   "embed": "the embedded all-MiniLM-L6-v2 (embeddings)"}
# Seconds between an engine failure and the process exit: errors reach clients, probes see 503.
FAULT_EXIT_GRACE_S = 2.0
# Seconds between checks that every model's engine is alive.
ENGINE_WATCH_S = 0.2
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
        if self.state.monitors is not None:
            self._spawn(self.state.monitors.run_embeddings())

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
        clients, timeout = self.state.clients, self.state.config.drain_timeout
        logger.info("waiting up to %.0f s for %d sequences in flight", timeout,
                    sum(c.num_seqs_in_flight for c in clients))
        idle = await asyncio.gather(*(c.wait_idle(timeout) for c in clients))
        if not all(idle):
            logger.warning("drain timeout: aborting %d sequences",
                           sum(c.num_seqs_in_flight for c in clients))
            for client in clients:
                client.abort_all()
            await asyncio.gather(*(c.wait_idle(CONNECTION_CLOSE_TIMEOUT_S) for c in clients))
        self.should_exit = True

    async def _watch_engine(self) -> None:
        """Exit (code 1) once any model's engine has died (models come and go: polled)."""
        while self.state.dead_reason is None:
            await asyncio.sleep(ENGINE_WATCH_S)
        logger.error("%s; exiting in %.0f s", self.state.dead_reason, FAULT_EXIT_GRACE_S)
        await asyncio.sleep(FAULT_EXIT_GRACE_S)
        self.exit_code = 1
        self.should_exit = True


def load_models(models: list[tuple[str | None, EngineConfig]],
                config: ServerConfig) -> ServerState:
    """Load every model (in order; a failure closes those already loaded) and build the
    server's state: one step loop for all engines, one metrics registry."""
    metrics = PrometheusMetrics()
    monitors = make_monitors(config.monitor, metrics)
    engines: list[tuple[str | None, LLMEngine]] = []
    try:
        for i, (name, engine_config) in enumerate(models, 1):
            logger.info("loading model %d of %d: %s%s", i, len(models),
                        f"{name} = " if name else "", model_label(engine_config))
            # Not in this thread: see load_engine_for_thread.
            engines.append((name, load_engine_for_thread(engine_config)))
        names = served_names(engines, config.served_model_name)
    except BaseException:
        for _, engine in engines:
            engine.close()
        raise
    state = ServerState(config, {}, metrics, monitors=monitors)
    if monitors is not None and any(e.task == EMBED for _, e in engines):
        monitors.embed = prompt_embedder(state)
    for i, (name, (_, engine)) in enumerate(zip(names, engines, strict=True)):
        state.models[name] = serve_engine(
            state, name, engine,
            debug_fail_at_step=config.debug_fail_at_step if i == 0 else None)
    return state


def model_label(config: EngineConfig) -> str:
    """What the start log calls a model: its path, or which embedded model runs without one."""
    if config.model.model:
        return config.model.model
    return EMBEDDED_MODELS["embed" if config.model.task == "embed" else "generate"]


def served_names(engines: list[tuple[str | None, LLMEngine]],
                 served_model_name: str | None) -> list[str]:
    """The name of each model: its spec's, --served-model-name (one model only), or the file's
    name; ValueError for a name given twice."""
    if served_model_name is not None and len(engines) > 1:
        raise ValueError("--served-model-name names the only model; with several, name each "
                         "one as --model NAME=PATH")
    names = [name or served_model_name or default_model_name(engine.model_path)
             for name, engine in engines]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two models are served as {name!r}: name them apart with "
                             "--model NAME=PATH")
    return names


def run_server(models: list[tuple[str | None, EngineConfig]], config: ServerConfig,
               make_config: Callable[[ModelSpec], EngineConfig] | None = None,
               lora_modules: Sequence[LoRAModule] = (),
               tenancy: TenancySettings | None = None) -> int:
    """Serve ``models`` ((name or None, config) each) and the LoRA adapters of
    ``lora_modules`` until SIGTERM (exit code 0) or an engine failure (exit code 1).
    ``make_config``: the EngineConfig of a model the admin API loads (needed with an admin
    key); ``tenancy``: the projects' options (with an admin key)."""
    check_lora_options([c for _, c in models], lora_modules,
                       config.allow_runtime_lora_updating)
    # The models and adapters load before the port opens: anything that answers is ready.
    state = load_models(models, config)
    try:
        load_lora_modules(state, lora_modules)
    except BaseException:
        for served in state.models.values():
            served.client.engine.close()
        raise
    manager = None
    if config.admin_key is not None or config.models_dir is not None:
        if make_config is None:
            raise ValueError("the admin API and loading on demand need make_config")
        budget = make_config.budget if isinstance(make_config, ModelFactory) else None
        started = {name: c for name, (_, c) in zip(state.models, models, strict=True)}
        manager = ModelManager(state, make_config, config.models_dir,
                               config.max_loaded_models, config.keep_alive, budget, started)
    if config.debug_fail_at_step is not None:
        logger.warning("fault injection is on: engine step %d will raise",
                       config.debug_fail_at_step)
    uv_config = uvicorn.Config(
        build_app(state, manager, build_retrieval(state, config), tenancy), host=config.host,
        port=config.port, log_level="info",
        timeout_graceful_shutdown=CONNECTION_CLOSE_TIMEOUT_S, lifespan="on",
        http=GuardedH11Protocol.configured(config.header_timeout, config.max_connections))
    server = _Server(uv_config, state)
    # Everything loaded so far lives as long as the server: out of the GC's full collections.
    frozen = freeze_startup_heap()
    logger.debug("froze %d start-up objects out of garbage collection", frozen)
    age = process_age_s()
    logger.info("serving %s on http://%s:%d/v1 (auth %s)%s",
                ", ".join([*(f"{m.name!r} ({m.task})" for m in state.models.values()),
                           *(f"{a.name!r} (LoRA on {a.base.name!r})"
                             for a in state.adapters.values() if a.base is not None)]),
                config.host, config.port, "on" if config.api_key else "off",
                "" if age is None else f"; ready {age:.1f} s after the process started")
    server.run()
    return server.exit_code
