import torch
from compilelm import ops
torch.manual_seed(0)
B, C, H, KVH, D, BS = 16, 16000, 32, 8, 128, 16
blocks = B * C // BS
q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
lens = torch.full((B,), C, dtype=torch.int32, device="cuda")
tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(B, C // BS)
for name, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
    kc = (torch.randn(blocks, BS, KVH, D, device="cuda") * 0.5).to(dt)
    vc = (torch.randn(blocks, BS, KVH, D, device="cuda") * 0.5).to(dt)
    fp8 = dt != torch.bfloat16
    for mma in (True, False):
        prev = torch.ops.compilelm.set_decode_mma(mma)
        args = (q, kc, vc, cu, lens, tables, D ** -0.5, 1) + ((True, 1.0, 1.0) if fp8 else ())
        for _ in range(5):
            out = ops.paged_attention(*args)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50):
            out = ops.paged_attention(*args)
        e.record(); torch.cuda.synchronize()
        us = s.elapsed_time(e) * 1e3 / 50
        gb = 2 * B * C * KVH * D * kc.element_size() / 1e9
        print(f"{name} mma={mma}: {us:.1f} us/layer, {gb / us * 1e6 / 1e3:.0f} GB/s, x32 layers {us*32/1e3:.2f} ms")
        torch.ops.compilelm.set_decode_mma(prev)
    del kc, vc
