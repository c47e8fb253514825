"""OpenAI's `logit_bias` ({token id: bias in [-100, 100]}) as a per-request logits processor."""

from __future__ import annotations

import torch


class LogitBiasProcessor:
    def __init__(self, bias: dict[int, float]):
        self.token_ids = torch.tensor(list(bias), dtype=torch.int64)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: fp32 [vocab]
        if self.token_ids.device != logits.device:
            self.token_ids = self.token_ids.to(logits.device)
            self.values = self.values.to(logits.device)
        return logits.index_add(0, self.token_ids, self.values)


def parse_logit_bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    """Keys are token ids as strings (JSON object keys); raises ValueError naming the bad one."""
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is out of vocabulary (size {vocab_size})")
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        bias[token_id] = float(value)
    return bias
