"""compilelm's graph passes and the API for writing new ones (see docs/writing_a_pass.md).

Only `PassConfig` is imported with the package; the other names load their module on first use
(they need Inductor's pattern matcher, which `CompileConfig` and eager engines never do)."""

import importlib

from compilelm.passes.config import PassConfig

# name -> the module of this package that defines it
_LAZY = {
    "CompilePass": "base", "FusionPass": "base", "pass_uuid": "base",
    "CleanupPass": "cleanup",
    "InplaceLoweringPass": "inplace_lowering", "register_inplace": "inplace_lowering",
    "PassManager": "manager", "load_pass": "manager",
    "NoOpEliminationPass": "noop_elimination",
    "PassRecord": "recorder", "PassRecorder": "recorder",
    "max_error": "verify", "random_inputs": "verify", "snapshot": "verify",
}

__all__ = sorted(["PassConfig", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
