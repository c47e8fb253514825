"""Process-wide compile counters: what the compiler did, so tests and reports can prove it
(e.g. "a warm start ran no Inductor compile", "identical pieces were compiled once")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class CompileCounters:
    dynamo_traces: int = 0  # graphs Dynamo handed to the compilelm backend
    pieces: int = 0  # compiled-piece call sites in split graphs (splitting ops excluded)
    unique_pieces: int = 0  # distinct pieces after deduplication
    inductor_compiles: int = 0  # Inductor runs (symbolic range + each static size)
    artifacts_loaded: int = 0  # compiled pieces loaded from the compile cache
    cache_hits: int = 0  # compile_model calls served entirely from the cache
    cache_misses: int = 0
    dynamo_free_starts: int = 0  # warm starts that skipped Dynamo altogether

    def snapshot(self) -> dict[str, int]:
        return asdict(self)

    def delta(self, before: dict[str, int]) -> dict[str, int]:
        return {k: v - before[k] for k, v in asdict(self).items()}

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)


compile_counters = CompileCounters()
