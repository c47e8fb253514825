"""Request fields the server does not know (`guided_json`, `mm_processor_kwargs`, ...), reported the
way vLLM reports them: never an error (openai-python sends `extra_body` keys at the top level),
never silent. Each field name is logged once per process, with vLLM's wording, and every response
to a request that carried some lists them in a `Warning` header (RFC 7234 code 299), so a client
can see what had no effect on its answer.

Names come from clients: only plain ones (letters, digits, `_.-`, at most 64) are logged or put in
the header (16 at most), the others are counted; at most `_MAX_LOGGED` names are remembered, and once that
many were logged new ones are no longer logged (the header still lists them)."""

from __future__ import annotations

import logging
import re
import threading

logger = logging.getLogger("compilelm")

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what goes into a header as is
_MAX_LOGGED = 256
_MAX_LISTED = 16  # names in one Warning header
_logged: set[str] = set()
_lock = threading.Lock()


def ignored_fields(body) -> list[str]:
    """The top-level fields of a parsed request (a pydantic model with extra="allow") that no
    model field took, in the order sent."""
    return list(body.model_extra or ())


def report_ignored(body) -> dict[str, str]:
    """Logs the names not logged before; returns the response headers to add ({} if none)."""
    names = ignored_fields(body)
    if not names:
        return {}
    shown = [n for n in names if _NAME.fullmatch(n)]
    with _lock:
        new = [n for n in shown if n not in _logged][: max(_MAX_LOGGED - len(_logged), 0)]
        _logged.update(new)
    if new:
        logger.warning("The following fields were present in the request but ignored: %s "
                       "(each name is logged once)", sorted(new))
    listed = shown[:_MAX_LISTED]
    if len(listed) < len(names):
        listed.append(f"and {len(names) - len(listed)} more")
    return {"Warning": f'299 compilelm "The following fields were present in the request but ignored: '
                       f'{", ".join(listed)}"'}
