"""Fusion passes, one per file: `fuse_<what>.py` holds `<What>FusionPass` (see docs/writing_a_pass.md)."""
