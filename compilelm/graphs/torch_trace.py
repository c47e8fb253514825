"""`TORCH_TRACE` during `compile --dump`: torch's structured compile log, written to DIR/trace,
is what `tlparse` reads (Dynamo's graphs and guards, AOT and Inductor graphs, output code,
Inductor's kernel provenance, compile times).

torch reads the TORCH_TRACE variable once, when it is imported; here the same handler is
installed on torch's trace logger for the length of one compile (and the variable is set, for
processes started meanwhile), then removed, so a dump in one process does not trace the next.
"""

from __future__ import annotations

import contextlib
import logging
import os

TLPARSE = "pip install tlparse && tlparse {trace}/*.log -o {out} --overwrite --no-browser"


@contextlib.contextmanager
def torch_trace(root: str):
    from torch._logging import _internal as logs

    handler = logs.LazyTraceHandler(root)
    handler.setFormatter(logs.TorchLogsFormatter(trace=True))
    old = os.environ.get(logs.TRACE_ENV_VAR)
    os.environ[logs.TRACE_ENV_VAR] = root
    logs.trace_log.addHandler(handler)
    try:
        yield
    finally:
        logs.trace_log.removeHandler(handler)
        handler.close()
        if old is None:
            os.environ.pop(logs.TRACE_ENV_VAR, None)
        else:
            os.environ[logs.TRACE_ENV_VAR] = old


@contextlib.contextmanager
def capture_artifacts(names: tuple[str, ...]):
    """Yields a dict that fills with the payloads of the structured-trace artifacts named `names`
    logged inside the block (name -> list of payload strings), e.g. Inductor's kernel provenance."""
    from torch._logging import _internal as logs

    found: dict[str, list[str]] = {n: [] for n in names}

    class Grab(logging.Handler):
        def emit(self, record):
            meta = getattr(record, "metadata", None) or {}
            name = (meta.get("artifact") or {}).get("name")
            if name in found and getattr(record, "payload", None) is not None:
                found[name].append(record.payload)

    grab = Grab(level=logging.DEBUG)
    logs.trace_log.addHandler(grab)
    try:
        yield found
    finally:
        logs.trace_log.removeHandler(grab)
