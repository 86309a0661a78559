"""AsyncLLM: the synchronous LLMEngine driven by one background thread, for asyncio front ends.

The engine is not thread-safe, so exactly one thread owns it and runs its step loop (a
``StepLoop``, which several engines of one server share, taking turns). The asyncio side never
touches the engine: it sends add / abort commands through a lock-protected list that
the loop drains between steps, and gets RequestOutputs (DELTA mode) back through per-call
asyncio queues fed with ``loop.call_soon_threadsafe``. When there is nothing to do the loop
sleeps on a condition variable, so an idle server uses no CPU.

If a step raises, the engine's state is unknown: every request in flight fails with
``EngineDeadError``, no new request is accepted, and ``dead`` is set so the server can exit.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine.output_processor import OutputKind
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.stats import StatLogger, StatsCollector
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests in flight are lost and no new one is accepted."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class InjectedFaultError(RuntimeError):
    """Raised on purpose by ``debug_fail_at_step`` (fault-injection testing only)."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    arrival_time: float
    # Compiled before sending, so the engine thread never compiles a grammar.
    grammar: object | None = None
    # Read and checked before sending, so the engine thread never reads an adapter's folder.
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


# Put on a request's queue once the engine thread has queued it in the engine.
_ACCEPTED = object()
# (prompt index within the group, RequestOutput | EmbeddingRequestOutput | error | _ACCEPTED)
_Item = tuple[int, object]
_Output = RequestOutput | EmbeddingRequestOutput


class RequestGroup:
    """The engine requests of one API call (one per prompt), delivered through one queue.

    Iterate to get ``(prompt_index, RequestOutput)`` pairs with per-step deltas, until every
    request has finished (an embedding request gives one EmbeddingRequestOutput). ``close()`` (always call it, e.g. in ``finally``) aborts what is left:
    that is how a client's disconnect frees the engine's KV blocks.
    """

    def __init__(self, client: AsyncLLM, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._client = client
        self._unfinished = set(range(len(request_ids)))
        self._early: collections.deque[_Item] = collections.deque()

    async def wait_accepted(self) -> None:
        """Wait until the engine queued every request; raise ValueError if it rejected one."""
        pending = len(self.request_ids)
        while pending:
            index, item = await self.queue.get()
            if item is _ACCEPTED:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                self._early.append((index, item))

    async def __aiter__(self) -> AsyncIterator[tuple[int, _Output]]:
        while self._unfinished:
            index, item = self._early.popleft() if self._early else await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, RequestOutput | EmbeddingRequestOutput):
                continue
            if item.finished:
                self._unfinished.discard(index)
                self._client._forget(self.request_ids[index])
            yield index, item

    def close(self) -> None:
        """Abort the requests that have not finished; safe to call more than once."""
        for index in sorted(self._unfinished):
            self._client._abort(self.request_ids[index])
        self._unfinished.clear()


async def collect_embeddings(group: RequestGroup) -> list[EmbeddingRequestOutput]:
    """The embeddings of a group of embedding requests, in the order of its prompts; closes
    the group. EngineDeadError if one was aborted (the engine is shutting down)."""
    results: list[EmbeddingRequestOutput | None] = [None] * len(group.request_ids)
    try:
        async for index, out in group:
            if not isinstance(out, EmbeddingRequestOutput) or out.finish_reason == "abort":
                raise EngineDeadError("the embedding request was aborted")
            results[index] = out
    finally:
        group.close()
    return results  # type: ignore[return-value]


def load_engine_for_thread(config: EngineConfig) -> LLMEngine:
    """Build an LLMEngine that another thread will step, in a short-lived thread of its own.

    Loading runs OpenMP parallel regions; the OpenMP runtime (libgomp) keeps a pool of worker
    threads per thread that ran them. If the main thread keeps such a pool while the engine
    thread builds another, there are more OpenMP threads than cores, and libgomp then stops
    spinning between parallel regions: every small region of a decode step pays a wake-up,
    which made single-stream decoding 2.3x slower on 2 cores. A pool goes away with its
    thread, so loading in a thread that ends leaves the engine thread the only pool.
    """
    box: dict[str, object] = {}

    def load() -> None:
        try:
            box["engine"] = LLMEngine(config)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=load, name="tokenmill-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["engine"]  # type: ignore[return-value]


class StepLoop:
    """The thread that steps one or more engines: in each turn, every engine with work runs its
    commands and one step. An idle loop sleeps on its condition variable.

    The engines of one server (a chat model and an embedding model) share one loop rather than
    a thread each: every thread that runs OpenMP regions keeps a pool of OpenMP workers, and
    once there are more workers than cores libgomp stops spinning between regions, which made
    decoding 2.3x slower on 2 cores (see ``load_engine_for_thread``). Taking turns on one
    thread also leaves each step all the cores.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._clients: list[AsyncLLM] = []
        self._thread: threading.Thread | None = None

    def attach(self, client: AsyncLLM) -> None:
        """Step ``client``'s engine from now on (starts the thread if it is not running)."""
        with self.cond:
            self._clients.append(client)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tokenmill-engine",
                                                daemon=True)
                self._thread.start()
            self.cond.notify()

    def detach(self, client: AsyncLLM) -> None:
        """Stop stepping ``client``'s engine (the thread ends with the last one)."""
        with self.cond:
            if client in self._clients:
                self._clients.remove(client)

    def _run(self) -> None:
        while True:
            with self.cond:
                work = self._wait_for_work()
                if work is None:
                    self._thread = None
                    return
            for client, commands in work:
                client._turn(commands)

    def _wait_for_work(self) -> list[tuple[AsyncLLM, list[_Add | _Abort]]] | None:
        """Each engine with work and its commands (None once no engine is attached); called
        with the condition held, sleeps on it while every engine is idle."""
        while True:
            if not self._clients:
                return None
            work = [(c, c._take_commands()) for c in self._clients if c._has_work()]
            if work:
                return work
            self.cond.wait()


class AsyncLLM:
    """An LLMEngine for asyncio code: ``await submit(...)``, iterate the returned group.

    At most ``max_num_seqs + max_queue`` sequences are in flight; more raise
    ``EngineOverloadedError``. ``debug_fail_at_step=N`` makes the N-th engine step raise
    ``InjectedFaultError``: it exists for fault-handling tests and is off (None) by default.
    """

    def __init__(self, engine: LLMEngine, *, max_queue: int = 128,
                 stat_loggers: Sequence[StatLogger] = (),
                 debug_fail_at_step: int | None = None,
                 step_loop: StepLoop | None = None) -> None:
        """``step_loop``: the thread to share with other engines (default: one of its own)."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.capacity = engine.config.scheduler.max_num_seqs + max_queue
        self.stat_loggers = list(stat_loggers)
        self.debug_fail_at_step = debug_fail_at_step
        self.dead: asyncio.Event | None = None  # created in start(), on the event loop
        self.dead_reason: str | None = None
        self._stats = StatsCollector()
        self._step_loop = step_loop or StepLoop()
        self._cond = self._step_loop.cond
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._started = False
        self._stopped = threading.Event()  # the step loop has let go of the engine
        self._num_steps = 0
        self._ids = itertools.count()
        # Loop-thread state: request id -> (its group, prompt index, sequences it holds).
        self._routes: dict[str, tuple[RequestGroup, int, int]] = {}
        self._num_seqs_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------- engine facts (read-only)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def compile_grammar(self, params: SamplingParams) -> object | None:
        """The engine's (cached) compiled grammar of ``params``; thread-safe."""
        return self.engine.compile_grammar(params)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences submitted and not yet finished or aborted."""
        return self._num_seqs_in_flight

    # ------------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start stepping the engine; call from the event loop that will use this client."""
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        self._started = True
        self._step_loop.attach(self)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight end with finish_reason "abort".
        Tensor-parallel worker processes stop with it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._started:
            await asyncio.to_thread(self._stopped.wait, timeout)
        if not self._started or self._stopped.is_set():
            self.engine.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._routes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._routes

    def abort_all(self) -> None:
        """Abort every request in flight; each still gets its final output ("abort")."""
        self._send([_Abort(rid) for rid in self._routes])

    # ------------------------------------------------------------------- requests, asyncio

    @property
    def task(self) -> str:
        """The engine's task: "generate" or "embed"."""
        return self.engine.task

    @property
    def embedding_size(self) -> int:
        """Entries of a full embedding."""
        return self.engine.embedding_size

    @property
    def cross_encoder(self) -> bool:
        """A cross-encoder: it scores pairs (see LLMEngine.cross_encoder)."""
        return self.engine.cross_encoder

    async def embed(self, prompts: Sequence[PromptType], params: PoolingParams,
                    request_id_prefix: str = "embd") -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt, in order, batched through the scheduler with
        whatever else runs. Raises like :meth:`submit`; cancelling aborts what is left."""
        return await collect_embeddings(await self.submit(prompts, params, request_id_prefix))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter off the event loop and off the engine thread
        (``LLMEngine.add_lora``); ValueError naming what is wrong."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.add_lora,
                                                         lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter held in host memory (requests running with it finish with it)."""
        return self.engine.remove_lora(lora_int_id)

    async def submit(self, prompts: Sequence[PromptType], params: SamplingParams | PoolingParams,
                     request_id_prefix: str = "req",
                     lora_request: LoRARequest | None = None) -> RequestGroup:
        """Queue one engine request per prompt, all with ``params`` (PoolingParams: embedding
        requests) and ``lora_request`` (None: the base model).

        Raises EngineDeadError, EngineOverloadedError, or ValueError (from the engine's own
        validation); nothing stays queued when it raises.
        """
        if self.dead_reason is not None or self._loop is None:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Off the event loop and off the engine thread; GrammarError is a ValueError.
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.compile_grammar, params)
        if lora_request is not None:
            await self.add_lora(lora_request)
        n = params.n if isinstance(params, SamplingParams) else 1
        num_seqs = len(prompts) * n
        if num_seqs > self.capacity:
            raise ValueError(f"the request needs {num_seqs} sequences (prompts x n) but this "
                             f"server runs at most {self.capacity} at once")
        if self._num_seqs_in_flight + num_seqs > self.capacity:
            raise EngineOverloadedError(
                f"{self._num_seqs_in_flight} sequences are in flight (limit {self.capacity})")
        ids = [f"{request_id_prefix}-{next(self._ids)}" for _ in prompts]
        group = RequestGroup(self, ids)
        for i, rid in enumerate(ids):
            self._routes[rid] = (group, i, n)
        self._num_seqs_in_flight += num_seqs
        now = time.monotonic()
        self._send([_Add(rid, p, params, now, grammar, lora_request)
                    for rid, p in zip(ids, prompts, strict=True)])
        try:
            await group.wait_accepted()
        except BaseException:
            group.close()
            for rid in ids:
                self._forget(rid)
            raise
        return group

    def _abort(self, request_id: str) -> None:
        if self._forget(request_id):
            self._send([_Abort(request_id)])

    def _forget(self, request_id: str) -> bool:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self._num_seqs_in_flight -= route[2]
        return route is not None

    def _send(self, commands: list[_Add | _Abort]) -> None:
        if not commands:
            return
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify()

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Runs on the event loop: route the engine thread's items to their groups."""
        for rid, item in items:
            route = self._routes.get(rid)
            if route is not None:
                route[0].queue.put_nowait((route[1], item))

    def _fail_all(self, reason: str) -> None:
        """Runs on the event loop once the engine thread has died."""
        assert self.dead is not None
        self.dead.set()
        for rid in list(self._routes):
            self._deliver([(rid, EngineDeadError(reason))])

    def _post(self, callback: object, arg: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, arg)  # type: ignore[arg-type]
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------- the engine thread

    def _has_work(self) -> bool:
        """Step-loop thread, condition held: commands, stopping, or requests to step."""
        return bool(self._commands) or self._stopping or self.engine.has_unfinished_requests()

    def _take_commands(self) -> list[_Add | _Abort]:
        """Step-loop thread, condition held: the commands sent since the last turn."""
        commands, self._commands = self._commands, []
        return commands

    def _turn(self, commands: list[_Add | _Abort]) -> None:
        """Step-loop thread: this engine's turn (or, when stopping, its last one)."""
        try:
            if self._stopping:
                self._round([_Abort(rid) for rid in self.engine.unfinished_request_ids()])
                self._leave()
            else:
                self._round(commands)
        except Exception as e:  # the engine's state is unknown now: fail everything
            logger.exception("the engine loop failed; failing all requests in flight")
            self.dead_reason = f"the engine failed: {type(e).__name__}: {e}"
            self._post(self._fail_all, self.dead_reason)
            self._leave()

    def _leave(self) -> None:
        """This engine is stepped no more (stopped or dead); other engines go on."""
        self._step_loop.detach(self)
        self._stopped.set()

    def _round(self, commands: list[_Add | _Abort]) -> None:
        """Apply commands, run one step if anything is unfinished, publish outputs and stats."""
        engine = self.engine
        items: list[tuple[str, object]] = []
        outputs: list[_Output] = []
        for cmd in commands:
            if isinstance(cmd, _Add):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                       kind=OutputKind.DELTA, arrival_time=cmd.arrival_time,
                                       grammar=cmd.grammar, lora_request=cmd.lora_request)
                    items.append((cmd.request_id, _ACCEPTED))
                except ValueError as e:
                    items.append((cmd.request_id, e))
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    # add_request leaves the engine as it was: only this request fails.
                    logger.exception("request %s could not be added", cmd.request_id)
                    items.append((cmd.request_id, e))
            elif (out := engine.abort_request(cmd.request_id)) is not None:
                outputs.append(out)
        batch_size = batch_tokens = 0
        if engine.has_unfinished_requests():
            self._num_steps += 1
            if self._num_steps == self.debug_fail_at_step:
                raise InjectedFaultError(f"debug_fail_at_step={self._num_steps}")
            outputs.extend(engine.step())
            batch_size, batch_tokens = engine.last_batch
        items.extend((o.request_id, o) for o in outputs)
        if items:
            self._post(self._deliver, items)
        iteration = self._stats.observe([o for o in outputs if isinstance(o, RequestOutput)],
                                        batch_size, batch_tokens)
        sched = engine.stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched, iteration)
