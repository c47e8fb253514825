"""CUDA graphs: capture and replay of the compiled model per padded batch size (GPU only).

A decode step of a small model is a few hundred short kernels; launching them one by one from
Python leaves the GPU idle between them. A CUDA graph records the launches once per batch size and
replays them with one call. Replays read and write fixed addresses, so every per-step input lives
in the static buffers of compilelm/graphs/step_inputs.py, filled by one copy per step.

    dispatch.py   which graph runs a step (full -> piecewise -> eager) and the capture sizes
    full.py       whole-model graphs for pure-decode batches, LM head and greedy argmax included
    piecewise.py  each compiled piece's graph per size, the attention ops eager between them

Both kinds are captured largest first into ONE memory pool (piecewise first), so the smaller ones
reuse the largest one's activation memory. Graphs hold the KV cache's addresses, so they are
captured after the cache exists; the engine sizes the cache leaving
`runtime/memory.cuda_memory_reserve` free (eager activations + the graphs + logits), and logs
the measured and estimated sizes after capture.
"""
