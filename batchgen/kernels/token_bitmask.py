"""Constrained decoding's token mask on the logits of the rows that have one, in place:

    logits[rows[c], t] = -inf   where bit t % 32 of bitmask[c, t // 32] is 0   (t < V)

bitmask [C, W] int32 holds one row per constrained logits row (W = ceil(V_mask / 32), the layout
xgrammar fills); rows [C] names the logits row each applies to, so unconstrained rows are neither
read nor written. Tokens at or past W * 32 (a padded LM head) are masked too.
"""
import torch
import triton
import triton.language as tl


# W follows the tokenizer (the warm-up's bitmask has the model's), rows are an index array: neither is
# specialized (kernels/__init__.py)
@triton.jit(do_not_specialize=["bitmask_stride_c", "words"], do_not_specialize_on_alignment=["bitmask_ptr", "rows_ptr"])
def _token_bitmask_kernel(
    logits_ptr,  # [S, V] fp32
    logits_stride_s,  # elements between two rows of logits
    bitmask_ptr,  # [C, W] int32
    bitmask_stride_c,  # elements between two rows of bitmask
    rows_ptr,  # [C] int64: the logits row of each bitmask row
    vocab,  # V
    words,  # W
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
):
    c = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1).to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask_ptr + c * bitmask_stride_c + word, mask=word < words, other=0)
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK // 32, 32]
    tokens = word[:, None] * 32 + tl.arange(0, 32)[None, :]
    row = tl.load(rows_ptr + c)
    tl.store(logits_ptr + row * logits_stride_s + tokens, float("-inf"), mask=(bits == 0) & (tokens < vocab))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
    num_rows, words = bitmask.shape
    if num_rows == 0:
        return
    vocab = logits.shape[1]
    block = 4096
    _token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits, logits.stride(0),
        bitmask, bitmask.stride(0),
        rows,
        vocab, words,
        BLOCK=block,
        num_warps=8,
    )


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    num_rows, words = bitmask.shape
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(num_rows, words * 32).bool()
    if words * 32 < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - words * 32), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [S, V] fp32 (in place), bitmask [C, W] int32, rows [C] int64 distinct."""
    if logits.is_cuda:
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)
