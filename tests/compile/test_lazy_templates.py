"""compilelm.graphs.lazy_templates: Inductor's kernel templates compile on first use, and render
exactly what the eagerly compiled template renders."""

import compilelm.graphs.compiler  # noqa: F401  (installs the lazy templates)
from compilelm.graphs.lazy_templates import LazyTemplate, install


def test_templates_built_at_import_are_lazy():
    from torch._inductor.codegen.common import KernelTemplate
    from torch._inductor.select_algorithm import TritonTemplate

    assert install() and KernelTemplate._template_from_string.lazy
    templates = TritonTemplate.all_templates
    assert "mm" in templates and all(isinstance(t.template, LazyTemplate) for t in templates.values())


def test_lazy_template_renders_like_the_eager_one():
    from torch._inductor.codegen.common import KernelTemplate

    proxy = KernelTemplate._template_from_string("def {{ name }}():\n    {{ body | indent_except_first(1) }}\n")
    assert isinstance(proxy, LazyTemplate) and proxy._compiled is None
    eager = proxy._compile(proxy._source)  # Inductor's own function, the Inductor filter included
    kwargs = dict(name="f", body="x = 1\nreturn x")
    assert proxy.render(**kwargs) == eager.render(**kwargs) == "def f():\n    x = 1\n    return x"
    assert proxy._compiled is not None and proxy._template() is proxy._compiled  # compiled once, then kept
