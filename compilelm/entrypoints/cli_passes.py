"""`compilelm passes list [-O N] [-cc JSON] [--pass SPEC]`: every graph pass, its stage, its
order and whether it is on at that level (with those overrides), without loading a model.

    stage        #  pass                        switch               on
    whole_graph  1  NoOpEliminationPass         eliminate_noops      yes
    whole_graph  2  RopeAttentionFusionPass     fuse_rope_attention  no (-O1)
    ...
"""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(sub) -> None:
    p = sub.add_parser("passes", help="list the compiler's graph passes (stage, order, on/off)")
    p.add_argument("action", choices=["list"], help="list: every pass, its stage, order and switch")
    p.add_argument("-O", "--optimization-level", dest="optimization_level", type=int, default=None,
                   choices=[0, 1, 2, 3], help="the level whose switches to show (default 2)")
    p.add_argument("--compilation-config", "-cc", default=None, help="JSON overriding CompileConfig fields")
    p.add_argument("--pass", dest="custom_passes", action="append", default=[],
                   metavar="MODULE:CLASS[,stage=S][,before=P|after=P]", help="add a custom pass (repeatable)")
    p.set_defaults(run=run)


def pass_table(level: int | None = None, overrides_json: str | None = None,
               custom_passes: tuple[str, ...] = ()) -> list[dict]:
    """One row per pass, in run order: stage, order, name, switch (None = custom / always on), on."""
    import json

    from compilelm.graphs import CompileConfig
    from compilelm.passes import PassConfig, PassManager
    from compilelm.passes.config import builtin_passes

    given = json.loads(overrides_json) if overrides_json else {}
    given["custom_passes"] = [*given.get("custom_passes", []), *custom_passes]
    config = CompileConfig.from_cli(level, json.dumps(given))
    everything = PassConfig(**{f.name: True for f in dataclasses.fields(PassConfig)})
    full = PassManager(everything, config.custom_passes)
    on = PassManager(config.passes, config.custom_passes) if config.level > 0 else None
    switch_of = {path.rpartition(":")[2]: switch for switch, path, _ in builtin_passes()}  # pass name -> switch
    rows = []
    stages = (("whole_graph", "whole_graph"), ("post_grad", "post_grad"), ("post_grad (tail)", "tail"))
    for stage, attr in stages:
        active = [p.name for p in getattr(on, attr)] if on is not None else []
        for i, p in enumerate(getattr(full, attr), 1):
            rows.append({"stage": stage, "order": i, "pass": p.name, "switch": switch_of.get(p.name),
                         "on": p.name in active})
    return rows


def run(args: argparse.Namespace) -> int:
    from compilelm.graphs import CompileConfig

    rows = pass_table(args.optimization_level, args.compilation_config, tuple(args.custom_passes))
    level = CompileConfig.from_cli(args.optimization_level, args.compilation_config).level
    header = ("stage", "#", "pass", "switch", f"on at -O{level}")
    table = [header] + [(r["stage"], str(r["order"]), r["pass"], r["switch"] or "-", "yes" if r["on"] else "no")
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
