"""The order in which decode attention visits a step's sequences: longest context first, so that no
long context starts last and runs alone while the SMs around it idle.

    order = a stable argsort of kv_lens, descending:
    rank_i = #{j : len_j > len_i} + #{j < i : len_j = len_i},   order[rank_i] = i
    schedule = [order; kv_lens[order]; req_rows[order]]   ([3, B] int32)

The schedule carries each sequence's length and token-table row beside its index, so a program reads
all three at once (not a length through the index). The kernel ranks by comparing every pair, on the
device (a CUDA graph holds it; the host never sees the lengths).
"""
import torch
import triton
import triton.language as tl

from batchgen.kernels.device import pdl_launch_args, wait_for_prior_kernels


# num_seqs follows the batch: not specialized; kv_lens may be a view at any offset (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs"],
            do_not_specialize_on_alignment=["kv_lens_ptr", "req_rows_ptr", "schedule_ptr"])
def _longest_first_kernel(
    kv_lens_ptr,  # [B] int32
    req_rows_ptr,  # [B] int32
    schedule_ptr,  # [3, B] int32 out: the sequences longest first, their kv_lens, their rows
    num_seqs,  # B
    BLOCK: tl.constexpr,  # sequences ranked a program, and compared against per iteration
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    wait_for_prior_kernels(PDL)
    mine = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = mine < num_seqs
    my_len = tl.load(kv_lens_ptr + mine, mask=valid, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_seqs, BLOCK):
        other = start + tl.arange(0, BLOCK)
        other_len = tl.load(kv_lens_ptr + other, mask=other < num_seqs, other=0)
        ahead = (other_len[None, :] > my_len[:, None]) | (
            (other_len[None, :] == my_len[:, None]) & (other[None, :] < mine[:, None]))
        ahead = ahead & (other[None, :] < num_seqs)
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(schedule_ptr + rank, mine, mask=valid)
    tl.store(schedule_ptr + num_seqs + rank, my_len, mask=valid)
    tl.store(schedule_ptr + 2 * num_seqs + rank, tl.load(req_rows_ptr + mine, mask=valid), mask=valid)


BLOCK = 64


def longest_first_triton(
    kv_lens: torch.Tensor, req_rows: torch.Tensor, out: torch.Tensor | None = None,
) -> torch.Tensor:
    num_seqs = kv_lens.shape[0]
    schedule = torch.empty((3, num_seqs), dtype=torch.int32, device=kv_lens.device) if out is None else out
    assert kv_lens.dtype == req_rows.dtype == torch.int32 and req_rows.shape == kv_lens.shape
    assert schedule.shape == (3, num_seqs) and schedule.dtype == torch.int32 and schedule.is_contiguous()
    if num_seqs:
        _longest_first_kernel[(triton.cdiv(num_seqs, BLOCK),)](kv_lens, req_rows, schedule, num_seqs, BLOCK=BLOCK,
                                                                **pdl_launch_args(kv_lens.device))
    return schedule


def longest_first_ref(kv_lens: torch.Tensor, req_rows: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(kv_lens, descending=True, stable=True)
    return torch.stack([order.to(torch.int32), kv_lens[order], req_rows[order]])


def is_ordered(num_seqs: int, device: torch.device) -> bool:
    """Whether decode attention takes these sequences through a schedule: two or more on a GPU (one has
    nothing to order; the CPU path reads them in index order)."""
    return num_seqs > 1 and device.type == "cuda"


def longest_first(kv_lens: torch.Tensor, req_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_lens, req_rows [B] int32 -> the schedule [3, B] int32: sequence indices longest context first
    (ties in index order), their kv_lens, their req_to_token rows (into out when given)."""
    if kv_lens.is_cuda:
        return longest_first_triton(kv_lens, req_rows, out)
    schedule = longest_first_ref(kv_lens, req_rows)
    return schedule if out is None else out.copy_(schedule)
