"""Read a raw SSE response the way a strict client would."""

from __future__ import annotations

import json


def read_events(http, path: str, body: dict) -> list:
    """POST with stream=True; returns the parsed `data:` payloads ("[DONE]" kept as a string).
    Fails on any line that is not `data: ...` or blank."""
    events = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
