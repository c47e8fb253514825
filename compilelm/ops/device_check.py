"""Whether this build's CUDA kernels run on a GPU, checked once at start-up (not at the first
launch, deep inside a step, as a bare "CUDA error").

csrc/cuda is compiled for the architectures of TORCH_CUDA_ARCH_LIST at build time (CMakeLists.txt;
default 9.0a: H100 / H200 only, since sm_90a code runs on nothing else). Rather than trusting a
list, `check_cuda_device` launches one tiny kernel (argmax_rows) on the device: a GPU the build
has no code for fails there with "no kernel image is available", which becomes an
UnsupportedDeviceError naming the GPU, its compute capability, the build's target and the ways
out. The Hopper-only paths are chosen by capability where they run, never assumed: thread-block
clusters and programmatic dependent launch need sm_90+ (csrc/cuda/launch.cuh,
paged_attention_decode.cu), the TMA / wgmma GEMMs sm_90 exactly (skinny_mm.cu, norm_gemm.py).
"""

from __future__ import annotations

import torch

BUILD_TARGET = "TORCH_CUDA_ARCH_LIST at build time (default 9.0a: H100 / H200 only)"
_NO_IMAGE = ("no kernel image is available", "invalid device function", "named symbol not found")


class UnsupportedDeviceError(RuntimeError):
    """This build's CUDA kernels cannot run on the requested GPU."""


def _probe(device: torch.device) -> None:
    torch.ops.compilelm.argmax_rows(torch.zeros(1, 8, device=device))
    torch.cuda.synchronize(device)


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("compilelm::argmax_rows", "CUDA")


def check_cuda_device(device: torch.device, probe=_probe, has_cuda_kernels=_has_cuda_kernels) -> None:
    """Raises UnsupportedDeviceError unless compilelm's CUDA kernels run on `device` (a CUDA
    device; anything else passes)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    gpu = f"{name} (cuda:{index}, compute capability {major}.{minor}, sm_{major}{minor})"
    way_out = ("Run on the CPU with --device cpu, or rebuild for this GPU: TORCH_CUDA_ARCH_LIST="
               f"'{major}.{minor}' pip install --no-build-isolation -e . (the Hopper-only paths, TMA/wgmma "
               "GEMMs, clusters and PDL, are then skipped by capability). --enforce-eager does not avoid "
               "these kernels: paged attention and the KV-cache write are csrc kernels at every -O level")
    if not has_cuda_kernels():
        raise UnsupportedDeviceError(f"compilelm was built without its CUDA kernels (no nvcc or a CPU torch at "
                                     f"build time), so it cannot run on {gpu}. {way_out}")
    try:
        probe(torch.device("cuda", index))
    except RuntimeError as e:
        if not any(s in str(e) for s in _NO_IMAGE):
            raise
        raise UnsupportedDeviceError(f"compilelm's CUDA kernels have no code for {gpu}: they were built for "
                                     f"{BUILD_TARGET}. {way_out}") from e
