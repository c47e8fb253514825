"""`--enable-log-requests`: one INFO line per engine request as it is admitted, as vLLM logs it
(prompt, sampling parameters, prompt token ids), each cut to `--max-log-len` characters / ids.
Off by default (vLLM's default too): prompts are user data."""

from __future__ import annotations

import logging

logger = logging.getLogger("compilelm")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None):
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        n = self.max_log_len
        if n is not None:
            prompt = None if prompt is None else prompt[:n]
            prompt_token_ids = prompt_token_ids[:n]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.", request_id, prompt,
                    _params_repr(params), prompt_token_ids)


def _params_repr(params) -> str:
    """SamplingParams without its logits processors' object reprs (addresses, closures)."""
    fields = {k: v for k, v in vars(params).items() if k != "logits_processors"}
    if params.logits_processors:
        fields["logits_processors"] = len(params.logits_processors)
    return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"
