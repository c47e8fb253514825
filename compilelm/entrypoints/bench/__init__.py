"""`compilelm bench latency | throughput | serve`: vLLM's `vllm bench` commands, with its flags,
its random dataset and its report, so a vLLM benchmark command line runs against compilelm
unchanged (latency and throughput in-process through `LLM`, serve as a client of a running
OpenAI-compatible server)."""
