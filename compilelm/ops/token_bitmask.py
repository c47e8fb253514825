"""mask_logits_rows_: a step's grammar masks applied to its constrained logits rows, one kernel.

The masks and the rows they apply to travel in one packed int32 array (one host -> device copy):
`packed[:k * words]` holds k masks of `words` int32 each (bit j of word w allows token 32 * w + j),
`packed[k * words:k * words + k]` the row of each. Refused tokens become -inf, in place. On CUDA
a Triton kernel (one program per row and block of the vocabulary); elsewhere the plain-torch
reference (tokens past the mask's width are refused).
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


def warm_up(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the kernel for these logits now (a server calls it at start: Triton's first
    compile, ~1 s, would otherwise stall every stream at the first constrained request)."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    packed = torch.zeros((vocab + 31) // 32 + 1, dtype=torch.int32, device=device)
    mask_logits_rows_(logits, packed, 1, (vocab + 31) // 32)
