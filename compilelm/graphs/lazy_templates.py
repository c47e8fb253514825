"""Inductor's kernel templates, compiled on first use instead of at import.

Importing Inductor's lowering builds ~20 `TritonTemplate`s (mm, bmm, conv, flex attention, ...),
and each compiles its jinja2 source as it is constructed: time in every process that loads the
compiler (docs/perf.md, "Compile and warm start"), on a warm start's critical path, where no
template is ever rendered (only max-autotune's template choices render them). Importing this
module (compiler.py and the pass base do, before any Inductor kernel module loads) makes
`KernelTemplate._template_from_string` return a `LazyTemplate`, which compiles the source with
Inductor's own function the first time anything of the template is used.
"""

from __future__ import annotations

import torch._inductor.codegen.common as inductor_common

_KernelTemplate = inductor_common.KernelTemplate


class LazyTemplate:
    """A jinja2 template compiled on first attribute access (`render`, `module`, ...). Its own
    names start with an underscore, so none hides one of the template's."""

    __slots__ = ("_compile", "_compiled", "_source")

    def __init__(self, source: str, compile):
        self._source, self._compile, self._compiled = source, compile, None

    def _template(self):
        if self._compiled is None:
            self._compiled = self._compile(self._source)
        return self._compiled

    def __getattr__(self, name):  # only names that are not slots or methods of this class
        return getattr(self._template(), name)


def install() -> bool:
    """Puts the lazy variant in place (once); False where Inductor has no jinja2 (its function
    then returns None, which a proxy must not hide) or its hook is not there."""
    eager = _KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(eager, staticmethod) or inductor_common.jinja2_env() is None:
        return False
    if getattr(eager.__func__, "lazy", False):
        return True
    compile_now = eager.__func__

    def lazy_template_from_string(source: str) -> LazyTemplate:
        return LazyTemplate(source, compile_now)

    lazy_template_from_string.lazy = True
    _KernelTemplate._template_from_string = staticmethod(lazy_template_from_string)
    return True


install()
