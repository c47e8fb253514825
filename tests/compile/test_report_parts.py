"""The report's parts that need no compile: the folded diff and the kernel table read from
Inductor's output code and its provenance artifacts."""

import json

from compilelm.graphs.kernels import ARTIFACTS, kernel_code, kernel_table
from compilelm.graphs.report_diff import diff_stats, folded_diff

LAYER = """    # File: model.py:{i} in forward
    mul_{i}: "f32[s0, 8]" = torch.ops.aten.mul.Tensor(x_{i}, w_{i});  x_{i} = None
    add_{i}: "f32[s0, 8]" = torch.ops.aten.add.Tensor(mul_{i}, 1)
    sub_{i}: "f32[s0, 8]" = torch.ops.aten.sub.Tensor(add_{i}, 1)
    div_{i}: "f32[s0, 8]" = torch.ops.aten.div.Tensor(sub_{i}, 2)
    x_{i} = div_{i}

"""


def test_folded_diff_shows_each_change_once_and_counts_repeats():
    before = "def forward(x):\n" + "".join(LAYER.format(i=i) for i in range(4)) + "    return add_3 < 1\n"
    after = before.replace("torch.ops.aten.add.Tensor(mul_", "torch.ops.fused.mul_add(mul_")
    table = folded_diff(before, after)
    assert table.count("<tbody>") == 1 and "(and 3 more like it, up to numbers)" in table
    assert table.count("class=\"old\"") == table.count("class=\"new\"") == 1
    assert "return add_3 &lt; 1" not in table  # folded: only context around the change
    assert diff_stats(before, after) == (4, 4)
    # FX's frees ("; x = None") are bookkeeping: dropping them changes nothing
    assert folded_diff(before, before.replace(";  x_0 = None", "")) == ""


CODE = '''
cpp_fused_norm_0 = async_compile.cpp_pybinding(['const float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0) {}
\'\'\')

async_compile.wait(globals())

class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        cpp_fused_norm_0(arg0_1, buf0)
        # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        buf2 = torch.ops.compilelm.rope_cache.default(buf1, 64)
        # [Provenance debug handles] cpp_fused_norm_0:4
        cpp_fused_norm_0(buf2, buf3)
        return (buf3, )

runner = Runner(partitions=[])
'''
ARTIFACT = ARTIFACTS[0]  # the node mappings
TRACE = '  File "/src/compilelm/models/llama.py", line {l}, in forward\n    {code}\n'


def test_kernel_table_follows_call_order_and_provenance():
    nodes = {"cpp_fused_norm_0:1": ["pow_1", "mean"], "extern_kernels.mm:2": ["mm"],
             "torch.ops.compilelm.rope_cache.default:3": ["rope_cache"], "cpp_fused_norm_0:4": ["pow_2"]}
    traces = {"cpp_fused_norm_0:1": [TRACE.format(l=10, code="h = self.norm(x)")],
              "cpp_fused_norm_0:4": [TRACE.format(l=20, code="h = self.post_norm(x)")]}
    artifacts = {ARTIFACT: [json.dumps({"cppCodeToPost": nodes})],
                 "inductor_provenance_tracking_kernel_stack_traces": [json.dumps(traces)]}
    table = kernel_table(CODE, artifacts)
    assert [k["name"] for k in table] == ["cpp_fused_norm_0", "extern_kernels.mm",
                                          "torch.ops.compilelm.rope_cache.default", "cpp_fused_norm_0"]
    assert [k["nodes"] for k in table] == [["pow_1", "mean"], ["mm"], ["rope_cache"], ["pow_2"]]
    assert table[0]["source"] == ["compilelm/models/llama.py:10 h = self.norm(x)"]
    assert table[3]["source"] == ["compilelm/models/llama.py:20 h = self.post_norm(x)"]
    assert table[0]["def_line"] == 2 and 'extern "C"' in kernel_code(CODE, table[0])
    assert kernel_code(CODE, table[1]).startswith("        # Topologically Sorted Source Nodes: [mm]")
    assert kernel_table(CODE)[2]["nodes"] == []  # no provenance: the calls alone
    # the handle Inductor writes above a call wins over counting calls by name
    moved = {**nodes, "cpp_fused_norm_0:4": ["pow_9"], "cpp_fused_norm_0:5": ["pow_2"]}
    artifacts[ARTIFACT] = [json.dumps({"cppCodeToPost": moved})]
    assert kernel_table(CODE, artifacts)[3]["nodes"] == ["pow_9"]
