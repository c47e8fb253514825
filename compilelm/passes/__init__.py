"""compilelm's graph passes and the API for writing new ones (see docs/writing_a_pass.md).

    base.py, fusion_pass.py          CompilePass (the hooks, identity, dumps); FusionPass (patterns)
    manager.py, config.py            the ordered pass list, the switches
                                     (config.py's BUILTIN_PASSES: one line registers a pass)
    fusion/                          one fusion per file: fuse_<what>.py holding <What>FusionPass
    utility/                         no-op elimination, linear routing, cleanup, in-place lowering
    debug/                           the recorder (dumps, report), --verify, the test harness

Only `PassConfig` is imported with the package; the other names load their module on first use
(they need Inductor's pattern matcher, which `CompileConfig` and eager engines never do)."""

import importlib

from compilelm.passes.config import PassConfig  # noqa: F401  (in __all__)

# name -> the module of this package that defines it
_LAZY = {
    "CompilePass": "base", "FusionPass": "fusion_pass", "pass_uuid": "base",
    "CleanupPass": "utility.cleanup",
    "InplaceLoweringPass": "utility.inplace_lowering", "register_inplace": "utility.inplace_lowering",
    "PassManager": "manager", "load_pass": "manager",
    "NoOpEliminationPass": "utility.noop_elimination",
    "PassRecord": "debug.recorder", "PassRecorder": "debug.recorder",
    "max_error": "debug.verify", "random_inputs": "debug.verify", "snapshot": "debug.verify",
}

__all__ = sorted(["PassConfig", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
