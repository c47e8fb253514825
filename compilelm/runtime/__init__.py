"""The serving runtime: requests, KV-cache blocks, scheduling, model running, the engine."""
