"""A packed attention batch with a shuffled token table, shared by the attention tests."""
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D], a view into a fused qkv output
    k_cache: torch.Tensor  # [num_slots, Hk, D]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [rows, max_len] int32
    req_rows: torch.Tensor  # [B] int32
    q_start: torch.Tensor  # [B] int32
    q_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32


def make_batch(
    seqs, q_heads, kv_heads, head_dim, dtype, device, seed=0, table_len=None, pad_tokens=0, num_slots=None
) -> Batch:
    """seqs: [(q_len, kv_len)] per sequence. Slots are a random permutation of the pool, request
    rows are shuffled, and unused table entries hold an out-of-range slot that must never be read.
    table_len: columns of req_to_token (default: the longest context + 5); pad_tokens: rows of q
    past the last sequence's (NaN); num_slots: size of the pool (default: the contexts' total + 7)."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in seqs]
    kv_lens = [kv for _, kv in seqs]
    num_slots = num_slots or sum(kv_lens) + 7
    rows = len(seqs) + 3
    req_to_token = torch.full((rows, table_len or max(kv_lens) + 5), 1 << 30, dtype=torch.int32)
    req_rows = torch.randperm(rows, generator=gen)[: len(seqs)]
    slots = torch.randperm(num_slots, generator=gen)
    used = 0
    for row, kv_len in zip(req_rows.tolist(), kv_lens):
        req_to_token[row, :kv_len] = slots[used : used + kv_len].int()
        used += kv_len
    total = sum(q_lens)
    qkv = torch.randn(total + pad_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv[total:] = float("nan")
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0)

    def dev(x, dt=torch.int32):
        return x.to(device=device, dtype=dt)

    return Batch(
        q=dev(qkv, dtype)[:, : q_heads * head_dim].view(total + pad_tokens, q_heads, head_dim),
        k_cache=dev(k_cache, dtype),
        v_cache=dev(v_cache, dtype),
        req_to_token=dev(req_to_token),
        req_rows=dev(req_rows),
        q_start=dev(q_start),
        q_lens=dev(torch.tensor(q_lens)),
        kv_lens=dev(torch.tensor(kv_lens)),
    )


def q_bounds(batch: Batch) -> torch.Tensor:
    """[B + 1] int32 cumulative query counts (each sequence's start, then the end), as the unified
    launch takes them."""
    zero = torch.zeros(1, dtype=torch.int32, device=batch.q_lens.device)
    return torch.cat((zero, batch.q_lens.cumsum(0).int()))
