"""Start real compilelm servers for the tests: a subprocess (`compilelm serve ...`) or an
in-process uvicorn thread around an AsyncLLMEngine the test controls."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

API_KEY = "sk-compilelm-test"
DUMMY = "dummy:smollm2-135m"  # random weights of the default model's shape: no weights to load


class ConnectionCounter:
    """An httpx request's `trace` extension: counts the TCP connections the client opens."""

    def __init__(self):
        self.opened = 0

    def __call__(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            self.opened += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, alive=lambda: True, log=lambda: "", status: int = 200,
                 interval: float = 0.2) -> None:
    """Poll /health until it answers `status` (503: the port is bound, the model still loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server exited during startup:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"/health never answered {status} in {timeout} s:\n{log()}")


def in_flight(url: str) -> float:
    """running + waiting requests, from /metrics (0 if unreachable)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("compilelm:num_requests_running", "compilelm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_in_flight(srv, n: int, timeout: float = 60) -> None:
    """Until `n` requests are running or waiting in the server's engine."""
    deadline = time.monotonic() + timeout
    while in_flight(srv.url) < n:
        assert time.monotonic() < deadline, "requests never reached the engine"
        time.sleep(0.1)


def stream_to_end(url: str, body: dict, out: dict, key: str, path: str = "/v1/completions",
                  ) -> None:
    """Reads a stream into `out[key]`, line by line as they come (an HTTP error replaces it)."""
    lines = out.setdefault(key, [])
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as e:
        out[key] = e


class RemoteServer:
    """`python -m compilelm.entrypoints.cli serve ARGS` (or another `module` with the same
    command line) on a free localhost port."""

    def __init__(self, args: list[str], timeout: float = 180.0, wait: bool = True,
                 module: str = "compilelm.entrypoints.cli"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="compilelm-serve-", suffix=".log",
                                                delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the suite shares 2 cores with the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "serve", *args,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait:
            wait_healthy(self.url, timeout, lambda: self.proc.poll() is None, self.log)

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def close(self) -> None:
        self.terminate()
        os.unlink(self._log.name)


class InProcessServer:
    """The app from `build_app` served by uvicorn in a thread, its engine thread started here."""

    def __init__(self, app, state, timeout: float = 120.0):
        import uvicorn

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        state.async_engine.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout, self.thread.is_alive)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.async_engine.shutdown()


def dummy_server(max_num_seqs: int, max_queue_len: int | None, step_delay: float = 0.0,
                 optimization_level: int | None = None, **app_kwargs) -> InProcessServer:
    """A 2-layer dummy engine behind the real app (`build_app(state, **app_kwargs)`), eager
    unless `optimization_level` is given (then compiled and warmed up before it is ready);
    `step_delay` slows each step down."""
    from compilelm.entrypoints.openai.api_server import build_app
    from compilelm.entrypoints.openai.metrics import ServerMetrics
    from compilelm.entrypoints.openai.serving_engine import ServerState
    from compilelm.llm import make_engine_config
    from compilelm.runtime.async_engine import AsyncLLMEngine
    from compilelm.runtime.engine import LLMEngine

    config = make_engine_config(DUMMY, model_overrides={"num_hidden_layers": 2}, max_model_len=256,
                                num_kv_blocks=80, max_num_seqs=max_num_seqs,
                                enforce_eager=optimization_level is None,
                                optimization_level=optimization_level)

    def factory():
        engine = LLMEngine(config)
        step = engine.step

        def slow_step():
            time.sleep(step_delay)
            return step()

        engine.step = slow_step
        return engine

    async_engine = AsyncLLMEngine(factory, max_queue_len=max_queue_len)
    state = ServerState(async_engine, ["dummy"])
    state.metrics = async_engine.metrics = ServerMetrics("dummy", lambda: async_engine.stats)
    return InProcessServer(build_app(state, **app_kwargs), state)
