"""A step's grammar masks on its constrained logits rows, one kernel: applied, or argmaxed.

The masks and the rows they apply to travel in one packed int32 array (one host -> device copy):
`packed[:k * words]` holds k masks of `words` int32 each (bit j of word w allows token 32 * w + j),
`packed[k * words:k * words + k]` the row of each. `mask_logits_rows_` makes refused tokens -inf,
in place (for rows that sample or report logprobs); `masked_argmax_rows_` writes only the argmax
of each masked row into the ids of a greedy batch (one kernel instead of mask, gather, argmax
and scatter: this runs on the engine thread every constrained step). On CUDA Triton kernels;
elsewhere the plain-torch references (tokens past the mask's width are refused).
"""

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU reference needs no Triton
    triton = None

_SHIFTS: dict[torch.device, Tensor] = {}  # [0, 1, ..., 31] int32 per device


def packed_rows(packed: Tensor, k: int, words: int) -> Tensor:
    """The rows of a packed array's k masks (int32 [k], a view)."""
    return packed[k * words:k * words + k]


def mask_logits_rows_ref(logits: Tensor, packed: Tensor, k: int, words: int) -> Tensor:
    # logits: [rows, vocab] (any float dtype); packed: int32 [>= k * words + k] on logits' device
    vocab = logits.shape[-1]
    masks, rows = packed[:k * words].view(k, words), packed_rows(packed, k, words).long()
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [k, words * 32 -> vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)


def mask_logits_rows_(logits: Tensor, packed: Tensor, k: int, words: int) -> Tensor:
    """In place; returns logits. `packed` must be on logits' device."""
    if triton is None or not logits.is_cuda or logits.stride(-1) != 1:
        return mask_logits_rows_ref(logits, packed, k, words)
    vocab = logits.shape[-1]
    block = 4096
    _mask_rows_kernel[(k, triton.cdiv(vocab, block))](logits, logits.stride(0), packed, k * words, words, vocab,
                                                      BLOCK=block)
    return logits


def masked_argmax_rows_ref(logits: Tensor, packed: Tensor, k: int, words: int, out: Tensor) -> Tensor:
    # logits: [rows, vocab]; out: int64 [rows], written at the k masked rows only
    rows = packed_rows(packed, k, words).long()
    masked = mask_logits_rows_ref(logits.index_select(0, rows), _renumbered(packed, k, words), k, words)
    return out.index_copy_(0, rows, masked.argmax(dim=-1))


def _renumbered(packed: Tensor, k: int, words: int) -> Tensor:
    """The packed array with rows 0..k-1 (its masks applied to the gathered rows)."""
    return torch.cat([packed[:k * words], torch.arange(k, dtype=packed.dtype, device=packed.device)])


def masked_argmax_rows_(logits: Tensor, packed: Tensor, k: int, words: int, out: Tensor) -> Tensor:
    """out[row] = the index of the first maximum of the row's allowed logits, for each masked row
    (NaN counts as the maximum, as in torch's argmax; the kernel ranks it with +inf, the first of
    them winning); out's other entries and the logits stay. Returns out. `packed` must be on
    logits' device; out: int64 [>= rows]."""
    if triton is None or not logits.is_cuda or logits.stride(-1) != 1 or not out.is_contiguous():
        return masked_argmax_rows_ref(logits, packed, k, words, out)
    _masked_argmax_kernel[(k,)](logits, logits.stride(0), packed, k * words, words, logits.shape[-1], out,
                                BLOCK=4096, num_warps=8)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["rows_offset"])  # k * words changes with k: one compile serves
    def _mask_rows_kernel(logits_ptr, stride_row, packed_ptr, rows_offset, words, vocab, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = tl.load(packed_ptr + rows_offset + r).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = cols < vocab
        in_mask = cols < words * 32
        word = tl.load(packed_ptr + r * words + cols // 32, mask=in_vocab & in_mask, other=0)
        allowed = ((word >> (cols % 32)) & 1) != 0
        refused = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * stride_row + cols, refused, mask=in_vocab & ~allowed)


    @triton.jit(do_not_specialize=["rows_offset"])
    def _masked_argmax_kernel(logits_ptr, stride_row, packed_ptr, rows_offset, words, vocab, out_ptr,
                              BLOCK: tl.constexpr):
        # one program per masked row: a running (max, first index) over the vocabulary in blocks
        r = tl.program_id(0)
        row = tl.load(packed_ptr + rows_offset + r).to(tl.int64)
        best = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_mask = (cols < vocab) & (cols < words * 32)
            word = tl.load(packed_ptr + r * words + cols // 32, mask=in_mask, other=0)
            allowed = in_mask & (((word >> (cols % 32)) & 1) != 0)
            x = tl.load(logits_ptr + row * stride_row + cols, mask=allowed, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)  # NaN: the maximum (then the first inf or NaN wins)
            x = tl.where(allowed, x, float("-inf"))
            m = tl.max(x, axis=0)
            idx = tl.min(tl.where(x == m, cols, vocab), axis=0).to(tl.int64)  # the block's first maximum
            take = m > best  # strictly: an earlier block keeps a tie
            best_idx = tl.where(take, idx, best_idx)
            best = tl.where(take, m, best)
        tl.store(out_ptr + row, best_idx)


def warm_up(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the kernels for these logits now (a server calls it at start: Triton's first
    compile, ~1 s, would otherwise stall every stream at the first constrained request)."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    packed = torch.zeros((vocab + 31) // 32 + 1, dtype=torch.int32, device=device)
    mask_logits_rows_(logits, packed, 1, (vocab + 31) // 32)
    masked_argmax_rows_(logits, packed, 1, (vocab + 31) // 32, torch.zeros(2, dtype=torch.int64, device=device))
