"""AsyncLLMEngine: one thread runs the LLMEngine loop; asyncio callers stream its outputs.

A model forward blocks for milliseconds to seconds, so it must never run on the event loop. The
engine thread builds the engine (weights, KV cache, compilation), then loops: drain the command
queue (add / abort), `step()`, and hand every RequestOutput to its caller's asyncio queue with
`loop.call_soon_threadsafe`. Requests from all callers share every step: continuous batching.

Failure model: a bad request (ValueError from `add_request`) fails only that request. An
exception inside `step()` kills the engine: it is logged, every in-flight request gets
`EngineDeadError`, and later calls fail at once (the server turns /health to 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from compilelm.outputs import RequestOutput
from compilelm.sampling_params import SamplingParams

logger = logging.getLogger("compilelm")

# the engine's cumulative stats (LLMEngine.stats()); the rest are gauges
_COUNTERS = ("num_preemptions", "prompt_tokens_total", "generation_tokens_total",
             "prefix_cache_queries", "prefix_cache_hits")


class EngineDeadError(RuntimeError):
    """The engine loop raised; nothing more can be served by this process."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or failed to load)."""


class QueueFullError(RuntimeError):
    """Admitting this request would exceed max_num_seqs + max_queue_len sequences."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown timeout ran out)."""


class AsyncLLMEngine:
    """`engine_factory` builds the LLMEngine inside the engine thread (so compilation and
    execution share a thread). `metrics` (optional, e.g. the server's ServerMetrics) gets
    `request_added` / `step_done` / `request_finished` calls from that thread.
    """

    def __init__(self, engine_factory: Callable[[], object], max_queue_len: int | None = None,
                 metrics=None):
        self._factory = engine_factory
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self.engine = None  # the LLMEngine, once loaded
        self.load_error: BaseException | None = None
        self.dead_error: EngineDeadError | None = None
        # snapshot of engine.stats(), refreshed by the engine thread; its counters count from
        # the moment the engine is ready (the start-up warm-up is not served work)
        self.stats: dict = {}
        self._counters_at_ready: dict = {}
        self._ready = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams and dead_error
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_seqs_in_flight = 0  # event-loop side: sequences admitted and not yet done
        self._thread = threading.Thread(target=self._run, name="compilelm-engine", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or self.load_error is not None

    @property
    def num_seqs_in_flight(self) -> int:
        return self._num_seqs_in_flight

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop the engine thread; True once it has ended. A thread still loading the model
        (weights, compilation) cannot take the stop until it is done: it is not waited for."""
        self._commands.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout if self._ready.is_set() else 0)
        return not self._thread.is_alive()

    # -- the asyncio side ----------------------------------------------------------------------

    def check_admission(self, num_seqs: int) -> None:
        """Raise if the engine cannot take `num_seqs` more sequences now."""
        if self.dead_error is not None:
            raise self.dead_error
        if not self.is_ready:
            raise EngineNotReadyError("the model is still loading")
        if self.max_queue_len is None or self._num_seqs_in_flight == 0:
            return  # an idle engine admits anything (a request larger than capacity included)
        capacity = self.engine.config.scheduler.max_num_seqs + self.max_queue_len
        if num_seqs > capacity:
            raise QueueFullError(f"this request needs {num_seqs} sequences, more than the server "
                                 f"holds (max_num_seqs + max_queue_len = {capacity}): it is "
                                 f"admitted only when no other request is in flight")
        if self._num_seqs_in_flight + num_seqs > capacity:
            raise QueueFullError(f"the server is at capacity ({self._num_seqs_in_flight} sequences "
                                 f"in flight, max_num_seqs + max_queue_len = {capacity})")

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 admitted: bool = False) -> RequestStream:
        """Admit a request now (raising QueueFullError, EngineDeadError, ...) and return the
        stream of its cumulative RequestOutputs. Must be called on the event loop. `admitted`:
        the caller has already passed `check_admission` for a whole that includes this request
        (the prompts of one HTTP request), earlier in the same turn of the event loop."""
        if not admitted:
            self.check_admission(params.n)
        stream = RequestStream(self, request_id, params, asyncio.get_running_loop())
        with self._lock:
            if self.dead_error is not None:
                raise self.dead_error
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (stream.loop, stream.queue)
        self._num_seqs_in_flight += params.n
        stream._closed = False
        self._commands.put(("add", request_id, prompt_token_ids, params, time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id, None))

    def abort_all(self) -> None:
        """Fail every in-flight request with RequestAbortedError (shutdown deadline)."""
        self._commands.put(("abort_all",))

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self._warm_up()
        except BaseException as e:  # noqa: BLE001 - reported to the server, which exits
            from compilelm.ops.device_check import UnsupportedDeviceError

            if isinstance(e, (ValueError, FileNotFoundError, UnsupportedDeviceError)):  # a config problem: one line
                logger.error("engine failed to load: %s", e)
            else:
                logger.exception("engine failed to load")
            self.engine, self.load_error = None, e
            self._ready.set()
            return
        stats = self.engine.stats()
        self._counters_at_ready = {k: stats[k] for k in _COUNTERS if k in stats}
        self._publish_stats()
        self._ready.set()
        engine = self.engine
        while True:
            try:
                if not self._drain_commands(block=not engine.has_unfinished_requests()):
                    return
                outputs = engine.step() if engine.has_unfinished_requests() else []
                self._publish_stats()  # before delivering: a client that got its answer sees it
                self._deliver(outputs)
            except BaseException as e:  # noqa: BLE001 - any failure here is fatal
                self._die(e)
                return

    def _warm_up(self) -> None:
        """Run one tiny request before serving when the model is compiled, so compilation
        happens now (and is logged) rather than inside the first client's request."""
        compilation = getattr(self.engine.config, "compilation", None)
        if compilation is None or getattr(compilation, "level", 0) == 0:
            return
        t0 = time.perf_counter()
        self.engine.add_request("__warmup__", [0, 0, 0], SamplingParams(max_tokens=2, ignore_eos=True))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        logger.info("engine warm-up (first prefill + decode, compiles the model) took %.1f s",
                    time.perf_counter() - t0)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False means stop. Blocks for the first one if `block`."""
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
                self._finished(cmd[1], "abort")
            elif kind == "abort_all":
                with self._lock:
                    streams, self._streams = self._streams, {}
                self.engine.abort_request(list(streams))
                for rid, stream in streams.items():
                    self._finished(rid, "abort")
                    _put(stream, RequestAbortedError("the server is shutting down and aborted "
                                                     "this request"))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             arrival: float) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted before it reached the engine
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival)
        except ValueError as e:
            with self._lock:
                self._streams.pop(request_id, None)
            _put(stream, e)
            return
        if self.metrics is not None:
            self.metrics.request_added(request_id, len(prompt_token_ids), params.n, arrival)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.metrics is not None:
            requests = self.engine.scheduler.requests

            def started(rid: str) -> bool:  # first scheduled: some of its tokens were computed
                req = requests.get(rid) or requests.get(f"{rid}#0")
                return req is None or req.num_computed_tokens > 0

            self.metrics.step_done(outputs, time.monotonic(), started)
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished:
                reasons = {c.finish_reason for c in out.outputs}
                self._finished(out.request_id, reasons.pop() if len(reasons) == 1 else "mixed")
            if stream is not None:
                _put(stream, out)

    def _die(self, error: BaseException) -> None:
        logger.exception("engine step failed; the engine is dead and fails all requests")
        dead = EngineDeadError(f"the engine failed: {type(error).__name__}: {error}")
        with self._lock:
            self.dead_error = dead
            streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self._finished(rid, "error")
            _put(stream, dead)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        for k, v in self._counters_at_ready.items():
            stats[k] -= v
        self.stats = stats

    def _finished(self, request_id: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.request_finished(request_id, reason)


class RequestStream:
    """The outputs of one request: `async for out in stream`, the last one `finished`.

    Closing it before the end (client gone, task cancelled, or simply dropped) aborts the
    request in the engine, which frees its KV blocks.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.num_seqs = params.n
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the engine side is done with it (finished, failed or aborted)
        self._closed = True  # until the engine counts it as in flight

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()  # outputs are cumulative: only the newest matters
        if isinstance(item, BaseException):
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine._num_seqs_in_flight -= self.num_seqs
        if not self.finished:
            self.engine.abort(self.request_id)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to free
            pass


def _put(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    """Hand `item` to a caller's queue from the engine thread (a closed loop is ignored)."""
    loop, q = stream
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the caller's event loop is gone
        pass
