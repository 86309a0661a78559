"""Models loaded, unloaded and swapped while the server runs (the admin API's engine side).

A swap is blue/green: the new version loads beside the old one (which keeps serving), takes the
name once it is up, and the old one drains (every request it holds runs to its end) before it
is unloaded. A load that fails changes nothing. Requests that resolved a model hold a lease on
it until the engine has queued them, so a drain never closes an engine a request is about to
reach.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.api.errors import APIError, bad_request
from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, load_engine_for_thread
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.live import LiveStats
from tokenmill.metrics.log_stats import LoggingStatLogger
from tokenmill.metrics.stats import StatLogger
from tokenmill.server.model_registry import LoadBudget, ModelSpec, parse_model_spec
from tokenmill.server.models_dir import default_max_loaded_models, path_inside, size_on_disk
from tokenmill.server.state import EMBED, GENERATE, ServedModel, ServerState

logger = logging.getLogger(__name__)

# Seconds between checks of a draining model.
DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class LoadRequest:
    """What an admin asks to load: a name, a path, engine options (as `--model` takes them)."""

    name: str
    path: str
    options: dict[str, Any]
    # A model the server was started with: its own config (path and options are not read).
    config: EngineConfig | None = None

    def spec(self) -> ModelSpec:
        """The `--model` spec these fields spell; ValueError naming a bad option."""
        parts = [f"{self.name}={self.path}"]
        for key, value in self.options.items():
            if not isinstance(key, str) or "," in key or "=" in key:
                raise ValueError(f"bad engine option name {key!r}")
            if value is True:
                parts.append(key)
            elif value is False or value is None:
                continue
            elif isinstance(value, int | float | str) and "," not in str(value):
                parts.append(f"{key}={value}")
            else:
                raise ValueError(f"engine option {key!r} must be a number, a string without "
                                 f"commas or true, got {value!r}")
        return parse_model_spec(",".join(parts))


def serve_engine(state: ServerState, name: str, engine: LLMEngine,
                 debug_fail_at_step: int | None = None) -> ServedModel:
    """A loaded engine as a served model: its client on the server's step loop, its metrics."""
    config = state.config
    task = EMBED if engine.task == EMBED else GENERATE
    prometheus = state.metrics.for_model(name)
    info = engine.model_info()
    prometheus.set_cache_config(info.kv_cache.block_size, info.kv_cache.num_blocks,
                                info.kv_cache.dtype or info.dtype,
                                engine.config.cache.enable_prefix_caching)
    live = LiveStats()
    loggers: list[StatLogger] = [prometheus, live]
    if config.log_stats_interval > 0:
        loggers.append(LoggingStatLogger(name, config.log_stats_interval))
    if state.monitors is not None and task == GENERATE:
        loggers.append(state.monitors.for_model(name))
    client = AsyncLLM(engine, max_queue=config.max_queue, stat_loggers=loggers,
                      step_loop=state.step_loop, debug_fail_at_step=debug_fail_at_step)
    return ServedModel(name, client, task, path=engine.model_path,
                       weight_bytes=info.weight_bytes, kv_cache_bytes=info.kv_cache.total_bytes,
                       live=live)


class ModelManager:
    """Loads, unloads and swaps the models of a running server; one change per name at once
    (another gets 409)."""

    def __init__(self, state: ServerState, make_config: Callable[[ModelSpec], EngineConfig],
                 models_dir: str | None = None, max_loaded_models: int | None = None,
                 keep_alive: float | None = None, budget: LoadBudget | None = None,
                 started: dict[str, EngineConfig] | None = None) -> None:
        self.state = state
        self.make_config = make_config
        self.models_dir = os.path.realpath(models_dir) if models_dir else None
        self.max_loaded_models = (max_loaded_models if max_loaded_models is not None
                                  else default_max_loaded_models(len(state.models)))
        self.keep_alive = keep_alive
        self.budget = budget if budget is not None else LoadBudget()
        # The models the server started with, by name: one unloaded loads back on demand
        # (the embedded models, say, are no files in --models-dir).
        self.started = dict(started or {})
        self._busy: dict[str, str] = {}  # name -> what is being done to it
        self._loading: dict[str, asyncio.Future[ServedModel]] = {}  # on-demand loads
        self._reaper: asyncio.Task[None] | None = None
        if self.models_dir is not None:
            state.load_on_demand = self.load_on_demand

    # ----------------------------------------------------------- on demand, as Ollama does

    def start(self) -> None:
        """Start unloading on-demand models idle for --keep-alive seconds (on the event loop)."""
        if self.keep_alive is not None and self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def load_on_demand(self, name: str) -> ServedModel | None:
        """Load ``name`` from --models-dir for a request that names it (None: no such model
        there). Every spelling of one file (``x.gguf``, ``./x.gguf``, its full path) is the
        one model, named by its path in the folder; requests for a model being loaded wait
        for that load."""
        if self.models_dir is None or name in self.state.models:
            return self.state.models.get(name)
        started = self.started.get(name)
        if started is not None:
            return await self._load_once(LoadRequest(name, started.model.model or name, {},
                                                     config=started), 0)
        try:
            path = self.resolve_path(name)
        except APIError:
            return None
        name = os.path.relpath(path, self.models_dir)
        served = self.state.models.get(name) or self._serving(path)
        if served is not None:
            return served
        return await self._load_once(LoadRequest(name, path, {}), size_on_disk(path))

    async def _load_once(self, req: LoadRequest, weight_bytes: int) -> ServedModel:
        """Load ``req`` on demand, once however many requests ask for it meanwhile."""
        pending = self._loading.get(req.name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[ServedModel] = asyncio.get_running_loop().create_future()
        self._loading[req.name] = future
        try:
            await self._make_room(weight_bytes)
            served = await self.load(req, on_demand=True)
            future.set_result(served)
            return served
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiting requests re-raise it themselves
            raise
        finally:
            del self._loading[req.name]

    def _serving(self, path: str) -> ServedModel | None:
        """A loaded model of the file or folder ``path`` (a real path), if there is one."""
        return next((m for m in self.state.models.values()
                     if m.path and os.path.realpath(m.path) == path), None)

    def _kv_left(self) -> int | None:
        """Bytes of the shared KV budget no loaded model holds (None: no shared budget)."""
        if self.budget.kv_bytes is None:
            return None
        return self.budget.kv_bytes - sum(m.kv_cache_bytes for m in self.state.models.values())

    async def _make_room(self, weight_bytes: int) -> None:
        """Unload the least recently used idle on-demand models while the server is at
        --max-loaded-models, has less than a fair share of the KV budget left (the budget over
        --max-loaded-models) or less free memory than the new model's ``weight_bytes``; 503
        when none is idle and the count is reached or nothing is left."""
        limit = self.max_loaded_models
        fair = None if self.budget.kv_bytes is None else self.budget.kv_bytes // limit
        while True:
            over = len(self.state.models) + len(self._loading) > limit
            left = self._kv_left()
            free = self.budget.free_memory() if self.budget.free_memory else None
            short_kv = left is not None and fair is not None and left < fair
            short_memory = free is not None and weight_bytes > free
            if not (over or short_kv or short_memory):
                return
            idle = [m for m in self.state.models.values() if self._unloadable(m)]
            if not idle:
                if over:
                    raise _capacity(f"{len(self.state.models)} models are loaded "
                                    f"(--max-loaded-models {limit}) and none is idle")
                if short_memory:
                    raise _capacity(f"the model takes {weight_bytes / 2**20:.0f} MiB and "
                                    f"{free / 2**20:.0f} MiB of memory are free")
                if left is not None and left <= 0:
                    raise _capacity("the loaded models hold the whole KV cache budget")
                return  # the new model takes what is left of the budget
            victim = min(idle, key=lambda m: m.last_used)
            logger.info("unloading %r (least recently used) to make room", victim.name)
            await self.unload(victim.name)

    async def _reap(self) -> None:
        """Unload on-demand models idle for longer than --keep-alive."""
        assert self.keep_alive is not None
        while True:
            await asyncio.sleep(min(self.keep_alive / 4, 5.0))
            now = time.monotonic()
            for m in list(self.state.models.values()):
                if (self._unloadable(m) and now - m.last_used > self.keep_alive
                        and len(self.state.models) > 1):
                    logger.info("unloading %r: idle for %.0f s (--keep-alive)", m.name,
                                now - m.last_used)
                    await self.unload(m.name)

    def _unloadable(self, m: ServedModel) -> bool:
        """Whether the model may be unloaded without being asked: loaded on demand, idle, not
        being changed, no LoRA adapter running on it."""
        return (m.on_demand and m.idle and m.name not in self._busy
                and not self.state.adapters_of(m.name))

    # ----------------------------------------------------------------- admin operations

    def describe(self) -> list[dict[str, Any]]:
        """Every model: name, path, task, state, memory, sequences in flight."""
        out = []
        for m in self.state.models.values():
            out.append({"name": m.name, "path": m.path, "task": m.task,
                        "state": self._busy.get(m.name, "serving"),
                        "weight_bytes": m.weight_bytes, "kv_cache_bytes": m.kv_cache_bytes,
                        "loaded_at": m.loaded_at, "on_demand": m.on_demand,
                        "requests_in_flight": m.client.num_seqs_in_flight})
        for name, what in self._busy.items():
            if name not in self.state.models:
                out.append({"name": name, "state": what})
        return out

    def resolve_path(self, path: str, param: str = "path") -> str:
        """``path`` inside --models-dir (relative paths are taken from it); 400 naming
        ``param`` when it is not there."""
        return path_inside(self.models_dir, path, param)

    async def load(self, req: LoadRequest, on_demand: bool = False) -> ServedModel:
        """Load a model under a new name; 409 if the name is taken or busy."""
        if req.name in self.state.models:
            raise APIError(409, f"a model named {req.name!r} is already loaded (swap it with "
                           "PUT /admin/models/{name})", param="name", code="model_exists")
        if req.name in self.state.adapters:
            raise APIError(409, f"a LoRA adapter is named {req.name!r}", param="name",
                           code="model_exists")
        with self._changing(req.name, "loading"):
            # On demand, the model takes its default size within what the budget has left.
            served = await self._build(req, kv_max_bytes=self._kv_left() if on_demand else None)
            served.on_demand = on_demand
            self.state.models[req.name] = served
            served.client.start()
        logger.info("loaded %r from %s", req.name, served.path)
        return served

    async def swap(self, req: LoadRequest) -> ServedModel:
        """Blue/green: load ``req`` beside the model of that name, route new requests to it,
        drain and unload the old one. Nothing changes if the load fails."""
        old = self._loaded(req.name)
        with self._changing(req.name, "swapping"):
            # The new version takes the old one's place in the KV budget unless told otherwise.
            new = await self._build(req, kv_cache_bytes=old.kv_cache_bytes)
            try:
                self._loaded(req.name)  # an adapter may have been put on it meanwhile
            except APIError:
                await new.client.shutdown()
                raise
            new.client.start()
            self.state.models[req.name] = new  # from here on new requests go to the new one
            logger.info("swapped %r to %s; draining the old version", req.name, new.path)
            await self._drain_and_close(old)
        return new

    async def unload(self, name: str) -> None:
        """Stop routing to the model, let its requests finish, unload it."""
        served = self._loaded(name)
        if len(self.state.models) == 1:
            raise APIError(409, "the last model cannot be unloaded (swap it instead)",
                           param="name", code="last_model")
        with self._changing(name, "unloading"):
            del self.state.models[name]
            await self._drain_and_close(served)
            # Its series go with it (/metrics would go on reporting a model no longer served).
            self.state.metrics.forget(name)
            if self.state.monitors is not None:
                self.state.monitors.forget(name)
        logger.info("unloaded %r", name)

    def _loaded(self, name: str) -> ServedModel:
        """The loaded model ``name``, which may change: 404 if there is none, 409 while LoRA
        adapters run on it (their requests would lose their engine)."""
        if name in self.state.adapters:
            raise APIError(400, f"{name!r} is a LoRA adapter, not a model: unload it with "
                           "POST /v1/unload_lora_adapter", param="name", code="is_adapter")
        served = self.state.models.get(name)
        if served is None:
            raise APIError(404, f"no model named {name!r} is loaded", param="name",
                           code="model_not_found")
        adapters = self.state.adapters_of(name)
        if adapters:
            raise APIError(409, f"the LoRA adapters {', '.join(map(repr, adapters))} run on "
                           f"{name!r}: unload them first (POST /v1/unload_lora_adapter)",
                           param="name", code="model_has_adapters")
        return served

    def _changing(self, name: str, what: str) -> _Change:
        if name in self._busy:
            raise APIError(409, f"the model {name!r} is already {self._busy[name]}",
                           param="name", code="model_busy")
        return _Change(self._busy, name, what)

    async def _build(self, req: LoadRequest, kv_cache_bytes: int | None = None,
                     kv_max_bytes: int | None = None) -> ServedModel:
        """Load the engine on a thread of its own (the server keeps serving); a failure is a
        400 with the reason. ``kv_cache_bytes``: the KV size unless the options set one;
        ``kv_max_bytes``: the most its default KV size may take."""
        try:
            config = req.config if req.config is not None else self._config_of(
                req, kv_cache_bytes)
            if kv_max_bytes is not None:
                config = _capped_kv(config, kv_max_bytes)
        except ValueError as e:
            raise bad_request(str(e)) from None
        try:
            engine = await asyncio.to_thread(load_engine_for_thread, config)
        except (ValueError, OSError, RuntimeError, MemoryError) as e:
            logger.warning("loading %r from %s failed: %s", req.name, req.path, e)
            raise APIError(400, f"loading {req.name!r} failed: {type(e).__name__}: {e}",
                           param="path", code="load_failed") from None
        return serve_engine(self.state, req.name, engine)

    def _config_of(self, req: LoadRequest, kv_cache_bytes: int | None) -> EngineConfig:
        """The EngineConfig ``req`` asks for, its paths inside --models-dir; ValueError or
        APIError naming what is wrong."""
        spec = req.spec()
        flags = spec.flags
        if kv_cache_bytes and not spec.own_kv_size:
            flags += ("--kv-cache-memory", str(kv_cache_bytes))
        spec = ModelSpec(spec.name, self.resolve_path(req.path), flags, spec.kv_share)
        spec = spec.with_paths(lambda path, option: self.resolve_path(path, f"options.{option}"))
        return self.make_config(spec)

    async def _drain_and_close(self, served: ServedModel) -> None:
        """Wait until no request holds or is about to reach the model, then close it."""
        while served.leases or served.client.num_seqs_in_flight:
            await asyncio.sleep(DRAIN_POLL_S)
        await served.client.shutdown()


def _capacity(why: str) -> APIError:
    return APIError(503, f"no room to load another model: {why}; retry later",
                    code="model_capacity", headers={"Retry-After": "5"})


class _Change:
    """Marks a name busy for the duration of a ``with`` block."""

    def __init__(self, busy: dict[str, str], name: str, what: str) -> None:
        self.busy, self.name, self.what = busy, name, what

    def __enter__(self) -> None:
        self.busy[self.name] = self.what

    def __exit__(self, *exc: object) -> None:
        self.busy.pop(self.name, None)


def _capped_kv(config: EngineConfig, kv_max_bytes: int) -> EngineConfig:
    """``config`` whose default KV size takes at most ``kv_max_bytes``; a size the options set
    (bytes or blocks) stays as it is."""
    cache = config.cache
    if cache.kv_cache_memory_bytes is not None or cache.num_blocks is not None:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(
        cache, kv_cache_max_bytes=max(kv_max_bytes, 1)))
