"""CompileConfig: levels, CLI parsing, validation errors that name the field."""

import pytest

from compilelm.graphs import CompileConfig
from compilelm.graphs.config import default_cache_dir
from compilelm.passes import PassConfig


def test_levels():
    assert CompileConfig.from_cli().level == 2
    assert CompileConfig.from_cli(1).cudagraph_mode == "piecewise"
    o3 = CompileConfig.from_cli(3)
    assert o3.compile_sizes == (1, 2, 4, 8) and o3.max_autotune
    eager = CompileConfig.from_cli(3, None, enforce_eager=True)
    assert eager.level == 0 and eager.cudagraph_mode == "none"


def test_user_fields_win_over_level_defaults():
    c = CompileConfig.from_cli(3, '{"compile_sizes": [16, 2, 2], "passes": {"eliminate_noops": false}}')
    assert c.compile_sizes == (2, 16)  # sorted, unique
    assert c.passes == PassConfig(eliminate_noops=False) and c.max_autotune


@pytest.mark.parametrize("overrides, field", [
    ('{"no_such_field": 1}', "no_such_field"),
    ('{"passes": {"fuse_everything": true}}', "fuse_everything"),
    ('{"passes": {"eliminate_noops": "yes"}}', "passes.eliminate_noops"),
    ('{"compile_sizes": [0]}', "compile_sizes"),
    ('{"compile_sizes": 8}', "compile_sizes"),
    ('{"splitting_ops": ["attention"]}', "splitting_ops"),
    ('{"cudagraph_mode": "sometimes"}', "cudagraph_mode"),
    ('{"custom_passes": ["no_colon"]}', "custom_passes"),
    ('{"use_cache": 1}', "use_cache"),
    ('{"level": 7}', "level"),
    ('not json', "JSON"),
    ('[1, 2]', "JSON object"),
])
def test_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        CompileConfig.from_cli(None, overrides)


def test_level_given_twice():
    with pytest.raises(ValueError, match="level given twice"):
        CompileConfig.from_cli(1, '{"level": 2}')
    assert CompileConfig.from_cli(None, '{"level": 1}').level == 1


def test_cache_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "compilelm" / "compile")
    c = CompileConfig()
    assert c.resolved_cache_dir == str(tmp_path / "compilelm" / "compile")
    assert c.resolved_inductor_cache_dir == str(tmp_path / "compilelm" / "compile" / "inductor")


def test_cache_key_ignores_paths_and_debug_fields():
    a = CompileConfig(cache_dir="/a", dump_dir="/d", verify_passes=True, cudagraph_capture_sizes=(1, 2))
    assert a.cache_key_dict() == CompileConfig().cache_key_dict()
    assert CompileConfig(compile_sizes=(4,)).cache_key_dict() != CompileConfig().cache_key_dict()


def test_inductor_options(make_config):
    from compilelm.graphs import CompiledModel
    from tests.compile.toy_model import ToyModel

    c = CompileConfig.from_cli(None, '{"inductor_options": {"cpp.threads": 1}}')
    assert c.inductor_options == (("cpp.threads", 1),) and hash(c)
    assert c.cache_key_dict() != CompileConfig().cache_key_dict()  # they change the compiled code
    with pytest.raises(ValueError, match="inductor_options"):
        CompileConfig.from_cli(None, '{"inductor_options": [1]}')
    with pytest.raises(ValueError, match="no_such_setting"):
        CompiledModel(ToyModel(num_layers=1), make_config(inductor_options={"no_such_setting": 1}), {})
