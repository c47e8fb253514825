"""compilelm's graph passes and the API for writing new ones (see docs/writing_a_pass.md)."""

from compilelm.passes.base import CompilePass, FusionPass, pass_uuid
from compilelm.passes.cleanup import CleanupPass
from compilelm.passes.config import PassConfig
from compilelm.passes.inplace_lowering import InplaceLoweringPass, register_inplace
from compilelm.passes.manager import PassManager, load_pass
from compilelm.passes.noop_elimination import NoOpEliminationPass
from compilelm.passes.recorder import PassRecord, PassRecorder
from compilelm.passes.verify import max_error, random_inputs, snapshot

__all__ = [
    "CleanupPass", "CompilePass", "FusionPass", "InplaceLoweringPass", "NoOpEliminationPass",
    "PassConfig", "PassManager", "PassRecord", "PassRecorder", "load_pass", "max_error",
    "pass_uuid", "random_inputs", "register_inplace", "snapshot",
]
