"""A GPU this build's CUDA kernels were not compiled for fails at start-up with a message naming it,
its compute capability, the build's target and the ways out, not with a CUDA error at the first
launch. CPU-only here: the GPU (name, capability) and the kernel probe are faked."""

from __future__ import annotations

import types

import pytest
import torch

from compilelm.ops.device_check import UnsupportedDeviceError, check_cuda_device


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA GeForce RTX 3090")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",  # read for the engine's step-limit defaults
                        lambda index=None: types.SimpleNamespace(name="NVIDIA GeForce RTX 3090", total_memory=24 << 30))


def _no_image(device):
    raise torch.AcceleratorError("CUDA error: no kernel image is available for execution on the device")


def test_a_gpu_the_kernels_were_not_built_for_is_named(fake_gpu):
    with pytest.raises(UnsupportedDeviceError) as e:
        check_cuda_device(torch.device("cuda"), probe=_no_image, has_cuda_kernels=lambda: True)
    msg = str(e.value)
    for part in ("NVIDIA GeForce RTX 3090", "compute capability 8.6", "sm_86", "9.0a", "--device cpu",
                 "TORCH_CUDA_ARCH_LIST='8.6'", "--enforce-eager does not avoid"):
        assert part in msg, (part, msg)


def test_a_build_without_cuda_kernels_says_so(fake_gpu):
    with pytest.raises(UnsupportedDeviceError, match="built without its CUDA kernels"):
        check_cuda_device(torch.device("cuda", 0))  # this CPU build has none


def test_supported_gpu_and_cpu_pass(fake_gpu):
    probed = []
    check_cuda_device(torch.device("cuda", 1), probe=probed.append, has_cuda_kernels=lambda: True)
    assert probed == [torch.device("cuda", 1)]
    check_cuda_device(torch.device("cpu"), probe=_no_image, has_cuda_kernels=lambda: False)


def test_other_cuda_errors_are_not_hidden(fake_gpu):
    def oom(device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        check_cuda_device(torch.device("cuda"), probe=oom, has_cuda_kernels=lambda: True)


def test_engine_start_fails_before_building_the_model(fake_gpu, monkeypatch):
    """LLM(device="cuda") on that GPU: the clear error, from the worker's start, before any weight."""
    from compilelm import LLM
    from compilelm.ops import device_check

    monkeypatch.setattr(device_check.check_cuda_device, "__defaults__", (_no_image, lambda: True))
    built = []
    monkeypatch.setattr("compilelm.runtime.worker.build_model", lambda *a, **k: built.append(1))
    with pytest.raises(UnsupportedDeviceError, match="RTX 3090"):
        LLM("dummy:smollm2-135m", device="cuda", enforce_eager=True, max_model_len=64, num_kv_blocks=16)
    assert not built
