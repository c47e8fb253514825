"""Compile one piece with Inductor, recognise identical pieces, and run a piece at run time.

Transformer layers produce byte-identical pieces (same ops, same shapes; only the weights,
which are inputs, differ), so `piece_key` hashes a piece's normalized structure and each key is
compiled once — typically 3 compiles (first, middle, last piece) for N + 1 pieces.

Each piece is compiled for the symbolic token range (`dynamic_shapes="from_tracing_context"`,
the shape environment Dynamo traced with) and for every static `compile_sizes` entry
(`"from_example_inputs"`, optionally with max-autotune). compilelm's PassManager runs inside
Inductor as its `post_grad_custom_post_pass`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable

import torch

from compilelm.graphs.split import Piece
from compilelm.passes.base import describe


def piece_key(piece: Piece) -> str:
    """Hash of the piece's ops, their wiring and constants, and its input metadata (names of
    nodes and placeholders are left out, so layer 3's piece equals layer 7's)."""
    index: dict[torch.fx.Node, int] = {}
    items = []
    for i, node in enumerate(piece.gm.graph.nodes):
        index[node] = i
        args = torch.fx.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        target = "" if node.op == "placeholder" else str(node.target)
        if node.op == "get_attr":  # a lifted constant: its value matters, not its name
            value = getattr(piece.gm, node.target)
            target = hashlib.sha256(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        items.append([node.op, target, repr(args)])
    items.append([describe(v) for v in piece.inputs])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:32]


def token_arg(piece: Piece) -> int | None:
    """Index of an input that carries the token count (a SymInt, or a tensor whose dim 0 is)."""
    for i, v in enumerate(piece.inputs):
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and v.dim()
                                           and isinstance(v.shape[0], torch.SymInt)):
            return i
    return None


# Per-call input checks in Inductor's wrapper code cost microseconds per tensor on every piece of
# every step; the pieces are only ever fed what they were compiled for.
_QUIET = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def inductor_patches(post_grad_pass, options: dict | None = None) -> dict:
    known = torch._inductor.config.get_config_copy()
    patches = {k: v for k, v in _QUIET.items() if k in known}  # (names differ across torch versions)
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        raise ValueError(f"inductor_options: unknown Inductor config setting(s): {', '.join(unknown)}")
    return {**patches, **(options or {}), "post_grad_custom_post_pass": post_grad_pass}


@contextlib.contextmanager
def bypass_caches():
    """Inductor's FX-graph and AOTAutograd caches off for the compiles inside (`--dump`,
    `--verify`): a cache hit would skip the post-grad passes. Yields Inductor config patches.
    standalone_compile's warning that such a compile has no artifact to save is silenced: a fresh
    compile is never stored."""
    log = logging.getLogger("torch._inductor.standalone_compile")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield {"fx_graph_cache": False}
    finally:
        log.setLevel(level)


def compile_piece(piece: Piece, post_grad_pass, size: int | None = None, max_autotune: bool = False,
                  options: dict | None = None):
    """Run Inductor on one piece: symbolic (size None) or specialised to `size` tokens."""
    patches = inductor_patches(post_grad_pass, options)
    if size is None:
        inputs, dynamic = piece.inputs, "from_tracing_context"
    else:
        inputs, dynamic = [_concrete(v, size) for v in piece.inputs], "from_example_inputs"
        if max_autotune:
            patches.update(max_autotune=True, coordinate_descent_tuning=True)
    return torch._inductor.standalone_compile(
        piece.gm, inputs, dynamic_shapes=dynamic, options={"config_patches": patches}
    )


def _concrete(v, size: int):
    """A real input of `size` tokens shaped like the fake `v` (every symbol is the token count)."""
    def subst(s):
        if isinstance(s, int):
            return s
        expr = s.node.expr
        return int(expr.subs(dict.fromkeys(expr.free_symbols, size)))

    if isinstance(v, torch.Tensor):
        shape = [subst(s) for s in v.shape]
        stride = [subst(s) for s in v.stride()]
        return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    if isinstance(v, torch.SymInt):
        return subst(v)
    return v


class PieceRunner:
    """One compiled piece at run time: the symbolic-range compile, plus static-size compiles
    picked by token count. This is also the CUDA-graph hook: a GPU runner captures and replays
    `__call__` per padded batch size (on CPU nothing wraps it)."""

    def __init__(self, name: str, key: str, dynamic: Callable, static: dict[int, Callable], token_arg: int | None):
        self.name = name
        self.key = key
        self.dynamic = dynamic
        self.static = static if token_arg is not None else {}
        self.token_arg = token_arg

    def __call__(self, *args):
        if self.static:
            n = args[self.token_arg]
            fn = self.static.get(n if isinstance(n, int) else n.shape[0])
            if fn is not None:
                return fn(*args)
        return self.dynamic(*args)

    @property
    def entry(self) -> Callable:
        """What the stitched graph calls: the compiled function itself when there is nothing to
        dispatch on (saves a Python call per piece)."""
        return self if self.static else self.dynamic
