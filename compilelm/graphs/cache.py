"""The on-disk compile cache: explicit, portable key; atomic writes; safe under concurrency.

Layout (documented in docs/writing_a_pass.md):

    <cache_dir>/                       default ~/.cache/compilelm/compile ($XDG_CACHE_HOME honoured)
      inductor/                        Inductor's own cache: built C++/Triton kernels, FX graphs
      <key>/cache_key_factors.json     everything the key was computed from, readable
      <key>/manifest.json              the stitched graph, its inputs, piece -> artifact table
      <key>/pieces/<piece>-<size>.bin  one Inductor artifact per unique piece and size

The key is a sha256 of named factors only — model config, compile config, pass uuids, hashes of
the compilelm source that defines models and the compiler, compilelm/torch/triton versions and
the device kind — never of environment variables or absolute paths, so it survives a restart and
a copy of the directory to another host with the same software and device.

Every file is written to a temporary name and `os.replace`d into place, and the manifest is
written last: two processes compiling the same model at once both succeed, and a reader sees
either no entry or a complete one.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import sys
import uuid

import torch

from compilelm.version import __version__

logger = logging.getLogger(__name__)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # compilelm/
# compilelm code whose change can change a compiled piece (model code is traced into it).
_SOURCE_DIRS = ("graphs", "passes", "models", "layers", "ops")


def source_hash(paths: list[str], root: str) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def device_kind(model: torch.nn.Module) -> dict:
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device))}
    # Inductor bakes the OpenMP thread count into its C++ kernels.
    return {"type": device.type, "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def cache_key_factors(model: torch.nn.Module, config, pass_uuids: dict, model_factors: dict) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    compilelm_files = [os.path.join(_PKG, "forward_context.py")]
    for d in _SOURCE_DIRS:
        compilelm_files += glob.glob(os.path.join(_PKG, d, "**", "*.py"), recursive=True)
    factors = {
        "model": model_factors,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "compile_config": config.cache_key_dict(),
        "passes": pass_uuids,
        "compilelm_source": source_hash(compilelm_files, _PKG),
        "versions": {"compilelm": __version__, "torch": torch.__version__, "triton": triton_version},
        "device": device_kind(model),
    }
    model_file = getattr(sys.modules.get(type(model).__module__), "__file__", None)
    if model_file and not os.path.abspath(model_file).startswith(_PKG + os.sep):  # a model from outside compilelm
        factors["model_source"] = source_hash([model_file], os.path.dirname(model_file))
    return factors


class CompileCache:
    def __init__(self, config, factors: dict):
        self.enabled = config.use_cache
        self.factors = factors
        self.key = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.dir = os.path.join(config.resolved_cache_dir, self.key)
        # Inductor's cache sits next to ours so a warm start finds its built kernels too.
        self.inductor_dir = config.resolved_inductor_cache_dir if self.enabled else None

    @contextlib.contextmanager
    def inductor_env(self):
        """Point Inductor's cache at our directory while compiling/loading (restored after)."""
        inductor_dir = self.inductor_dir
        if inductor_dir is None:
            yield
            return
        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old

    def artifact_path(self, name: str) -> str:
        return os.path.join(self.dir, "pieces", name)

    def load_manifest(self) -> dict | None:
        if not self.enabled:
            return None
        try:
            with open(os.path.join(self.dir, "manifest.json")) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
        files = [f for piece in manifest.get("pieces", {}).values() for f in piece["files"].values()]
        return manifest if all(os.path.exists(self.artifact_path(f)) for f in files) else None

    def save_manifest(self, manifest: dict) -> None:
        if not self.enabled:
            return
        atomic_write(os.path.join(self.dir, "cache_key_factors.json"),
                     json.dumps(self.factors, indent=2, sort_keys=True, default=str))
        atomic_write(os.path.join(self.dir, "manifest.json"), json.dumps(manifest, indent=1))

    def load_artifact(self, name: str):
        """The compiled piece, or None if absent or unreadable (then it is compiled again)."""
        path = self.artifact_path(name)
        if not self.enabled or not os.path.exists(path):
            return None
        try:
            return torch._inductor.CompiledArtifact.load(path=path, format="binary")
        except Exception as e:  # corrupt or from an incompatible torch: recompile, don't fail
            logger.warning("ignoring unreadable compile-cache artifact %s: %s", path, e)
            return None

    def save_artifact(self, name: str, artifact) -> None:
        if not self.enabled:
            return
        path = self.artifact_path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            artifact.save(path=tmp, format="binary")
            os.replace(tmp, path)
        except Exception as e:  # e.g. a graph Inductor cannot serialize: still usable, just not cached
            logger.warning("could not save compile-cache artifact %s: %s", path, e)
            with contextlib.suppress(OSError):
                os.remove(tmp)


def atomic_write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
