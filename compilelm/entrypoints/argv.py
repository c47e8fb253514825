"""vLLM's command-line conventions, applied to argv before argparse sees it.

- `--config FILE.yaml`: each `key: value` becomes `--key value` (true -> `--key`, false ->
  `--no-key` where that flag exists, a list -> `--key v1 v2`, a mapping -> `--key JSON`), placed
  right after the subcommand and its positional argument, so flags typed on the command line win.
- `--max_model_len` == `--max-model-len` (underscores in a flag's name, before any `.`).
- dotted overrides of a JSON flag: `-O.level=3`, `-O.cudagraph_mode none`, `-cc.use_cache=false`,
  `--compilation-config.passes.fuse_qkv_rope=false` merge into one `--compilation-config` JSON
  (values parsed as JSON, else kept as strings); `-O=3` == `-O3`.
"""

from __future__ import annotations

import argparse
import json
import re

_DOTTED_ALIASES = {"-O": "--compilation-config", "-cc": "--compilation-config"}
_FLAG_NAME = re.compile(r"(?<=^--)[^.=]*")


class ConfigFileError(ValueError):
    """An unreadable or malformed --config file (the message names the flag)."""


def expand_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        argv = _pull_config_file(argv, parser)
    out = []
    for arg in argv:
        if arg.startswith("--"):
            arg = _FLAG_NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1)
        elif arg.startswith("-O=") and arg[3:].isdigit():
            arg = "-O" + arg[3:]
        out.append(arg)
    return _merge_dotted(out)


def _pull_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    at = next(i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            raise ConfigFileError("--config: expected a YAML file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    if sum(a == "--config" or a.startswith("--config=") for a in rest):
        raise ConfigFileError("--config: given more than once")
    flags = config_file_args(path, _option_strings(parser, rest))
    # after the subcommand and its positional argument (the model, the prompt): a list-valued
    # flag from the file must not swallow it; what follows on the command line overrides the file
    cut = 1 + (len(rest) > 1 and not rest[1].startswith("-"))
    return rest[:cut] + flags + rest[cut:]


def _option_strings(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The flags of the subcommand in argv[0] (for `--no-KEY`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            return set(action.choices[argv[0]]._option_string_actions)
    return set(parser._option_string_actions)


def config_file_args(path: str, known: set[str]) -> list[str]:
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ConfigFileError(f"--config: {path} is not a .yaml / .yml file")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"--config: cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config: {path} is not valid YAML: {e}") from e
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigFileError(f"--config: {path} must map flag names to values, got {type(config).__name__}")
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif f"--no-{flag[2:]}" in known:
                args.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            if value:
                args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def _merge_dotted(argv: list[str]) -> list[str]:
    out: list[str] = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        head = arg.split("=", 1)[0]
        base, dot, dotted = head.partition(".")
        if arg.startswith("-") and dot and dotted and (base.startswith("--") or base in _DOTTED_ALIASES):
            if "=" in arg:
                raw = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                raw, i = argv[i + 1], i + 1
            else:
                raise ConfigFileError(f"{head}: expected a value")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            node = merged.setdefault(_DOTTED_ALIASES.get(base, base), {})
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        else:
            out.append(arg)
        i += 1
    for flag, value in merged.items():
        if flag in out:  # the flag's own JSON too: the dotted keys are laid over it
            at = out.index(flag)
            try:
                base_value = json.loads(out[at + 1])
            except (IndexError, json.JSONDecodeError) as e:
                raise ConfigFileError(f"{flag}: not valid JSON") from e
            value = _deep_merge(base_value, value) if isinstance(base_value, dict) else value
            del out[at: at + 2]
        out += [flag, json.dumps(value)]
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    result = dict(base)
    for k, v in over.items():
        result[k] = _deep_merge(result[k], v) if isinstance(v, dict) and isinstance(result.get(k), dict) else v
    return result
