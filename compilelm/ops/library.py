"""The `compilelm` op namespace's Python fragment: ops defined in Python rather than csrc/ops.cpp.

`define` registers the decorated function as `compilelm::<schema>` with one kernel for every device
(CompositeExplicitAutograd) and a fake impl, through torch.library's low-level API rather than
`torch.library.custom_op`: these ops run eagerly between the compiled pieces (or inside them, as
graph nodes that call our C++ kernels), and custom_op wraps every call in Python checks (device
dispatch, output aliasing) that cost host time on every step (docs/perf.md, "Host overhead and
async scheduling").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("compilelm", "FRAGMENT")  # the namespace is csrc/ops.cpp's


def like_first(x: torch.Tensor, *args) -> torch.Tensor:
    """The default fake: empty_like the first argument (its strides too)."""
    return torch.empty_like(x)


def define(schema: str, fake: Callable = like_first) -> Callable:
    """Decorator: registers the function as compilelm::<schema>, functional unless the schema
    says otherwise, the same kernel on every device, with `fake` for tracing."""
    name = schema.split("(", 1)[0]

    def register(fn):
        LIB.define(schema)
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"compilelm::{name}", fake, lib=LIB)
        return fn

    return register
