"""A decode-only step's packed inputs -> the static inputs of its decode graph, on the device.

The engine stages a step as one int64 array (executor/step_inputs.py): S scalars, then the size of each
of F arrays, then the arrays. For a decode-only step replayed from a graph, this op reads that array
where the host copied it (a static device buffer) and writes, for the graph's P slots:

    i <  n (the step's decodes):  input_ids[i] = input id, or last_tokens[src] where the token is
                                  still being sampled (pending_dst[j] == i -> src = pending_src[j]);
                                  positions, out_slots, seq_rows, kv_lens from the arrays;
                                  req_to_token[row_i, position_i] = out_slot_i
    n <= i < P (padding):         input_ids 0, position 0, out_slot pad_slot, seq_row pad_row, kv_len 1

so that the host issues one copy a step and the graph does the rest (no per-array copies, no
scatter of pending tokens, no token-table write outside it). pending_dst is ascending (the engine
lists decodes in order), which the kernel's binary search relies on.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

# The arrays of the packed layout the op reads (the caller passes the layout's field names).
READ_FIELDS = ("input_ids", "positions", "out_slots", "pending_dst", "pending_src", "rows", "kv_lens")


@triton.jit
def _field_start(starts, f, F: tl.constexpr):
    return tl.sum(tl.where(f == F, starts, 0), axis=0)


@triton.jit
def _unpack_decode_kernel(
    packed_ptr,  # [L] int64: NUM_SCALARS scalars (the first: n), NUM_FIELDS sizes, the arrays
    last_tokens_ptr,  # [S_prev] int64: the tokens of the step in flight
    input_ids_ptr,  # [P] int64
    positions_ptr,  # [P] int64
    out_slots_ptr,  # [P] int64
    seq_rows_ptr,  # [P] int32
    kv_lens_ptr,  # [P] int32
    req_to_token_ptr,  # [rows, width] int32
    req_to_token_stride,
    pad_slot,
    pad_row,
    size,  # P
    NUM_SCALARS: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    F_IDS: tl.constexpr, F_POS: tl.constexpr, F_SLOTS: tl.constexpr, F_DST: tl.constexpr,
    F_SRC: tl.constexpr, F_ROWS: tl.constexpr, F_LENS: tl.constexpr,  # indices of FIELDS
    BLOCK: tl.constexpr,  # slots per program
    BLOCK_F: tl.constexpr,  # next power of 2 >= NUM_FIELDS
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(P + 1)): the binary search over pending_dst
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(packed_ptr)
    f = tl.arange(0, BLOCK_F)
    sizes = tl.load(packed_ptr + NUM_SCALARS + f, mask=f < NUM_FIELDS, other=0)
    starts = NUM_SCALARS + NUM_FIELDS + tl.cumsum(sizes, axis=0) - sizes  # where each array begins
    real = i < n
    ids = tl.load(packed_ptr + _field_start(starts, f, F_IDS) + i, mask=real, other=0)
    pos = tl.load(packed_ptr + _field_start(starts, f, F_POS) + i, mask=real, other=0)
    slot = tl.load(packed_ptr + _field_start(starts, f, F_SLOTS) + i, mask=real, other=pad_slot)
    row = tl.load(packed_ptr + _field_start(starts, f, F_ROWS) + i, mask=real, other=pad_row)
    kv_len = tl.load(packed_ptr + _field_start(starts, f, F_LENS) + i, mask=real, other=1)
    # pending tokens: the first j with pending_dst[j] >= i (binary search), taken if it is i
    num_pending = tl.sum(tl.where(f == F_DST, sizes, 0), axis=0)
    dst_ptr = packed_ptr + _field_start(starts, f, F_DST)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = lo + num_pending
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        d = tl.load(dst_ptr + mid, mask=active, other=0)
        less = active & (d < i)
        lo = tl.where(less, mid + 1, lo)
        hi = tl.where(active & (d >= i), mid, hi)
    found = real & (lo < num_pending)
    found = found & (tl.load(dst_ptr + lo, mask=found, other=-1) == i)
    src = tl.load(packed_ptr + _field_start(starts, f, F_SRC) + lo, mask=found, other=0)
    ids = tl.where(found, tl.load(last_tokens_ptr + src, mask=found, other=0), ids)
    ok = i < size
    tl.store(input_ids_ptr + i, ids, mask=ok)
    tl.store(positions_ptr + i, pos, mask=ok)
    tl.store(out_slots_ptr + i, slot, mask=ok)
    tl.store(seq_rows_ptr + i, row.to(tl.int32), mask=ok)
    tl.store(kv_lens_ptr + i, kv_len.to(tl.int32), mask=ok)
    tl.store(req_to_token_ptr + row * req_to_token_stride + pos, slot.to(tl.int32), mask=real)


def unpack_decode_triton(packed, last_tokens, input_ids, positions, out_slots, seq_rows, kv_lens, req_to_token,
                         pad_slot: int, pad_row: int, num_scalars: int, field_names: tuple[str, ...]) -> None:
    size = input_ids.shape[0]
    block = min(triton.next_power_of_2(max(size, 1)), 128)
    index = {name: field_names.index(name) for name in READ_FIELDS}
    _unpack_decode_kernel[(triton.cdiv(size, block),)](
        packed, last_tokens, input_ids, positions, out_slots, seq_rows, kv_lens, req_to_token,
        req_to_token.stride(0), pad_slot, pad_row, size,
        NUM_SCALARS=num_scalars, NUM_FIELDS=len(field_names),
        F_IDS=index["input_ids"], F_POS=index["positions"], F_SLOTS=index["out_slots"],
        F_DST=index["pending_dst"], F_SRC=index["pending_src"], F_ROWS=index["rows"], F_LENS=index["kv_lens"],
        BLOCK=block, BLOCK_F=triton.next_power_of_2(len(field_names)), SEARCH_STEPS=size.bit_length(),
        num_warps=1 if block <= 64 else 4,
    )


def unpack_decode_ref(packed, last_tokens, input_ids, positions, out_slots, seq_rows, kv_lens, req_to_token,
                      pad_slot: int, pad_row: int, num_scalars: int, field_names: tuple[str, ...]) -> None:
    header = packed[: num_scalars + len(field_names)].tolist()
    n, sizes = header[0], header[num_scalars:]
    starts = itertools.accumulate([num_scalars + len(field_names), *sizes])
    a = {name: packed[start : start + k] for name, start, k in zip(field_names, starts, sizes)}
    ids = a["input_ids"].clone()
    ids[a["pending_dst"]] = last_tokens[a["pending_src"]]
    for out, values, pad in ((input_ids, ids, 0), (positions, a["positions"], 0), (out_slots, a["out_slots"], pad_slot),
                             (seq_rows, a["rows"], pad_row), (kv_lens, a["kv_lens"], 1)):
        out[:n] = values
        out[n:] = pad
    req_to_token[a["rows"], a["positions"]] = a["out_slots"].to(torch.int32)


def unpack_decode(packed: torch.Tensor, last_tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                  out_slots: torch.Tensor, seq_rows: torch.Tensor, kv_lens: torch.Tensor, req_to_token: torch.Tensor,
                  pad_slot: int, pad_row: int, num_scalars: int, field_names: tuple[str, ...]) -> None:
    """packed [L] int64 (a decode-only step, n <= P decodes); input_ids, positions, out_slots [P] int64 and
    seq_rows, kv_lens [P] int32 are written; req_to_token [rows, width] int32 gets the decodes' slots."""
    fn = unpack_decode_triton if packed.is_cuda else unpack_decode_ref
    fn(packed, last_tokens, input_ids, positions, out_slots, seq_rows, kv_lens, req_to_token, pad_slot, pad_row,
       num_scalars, field_names)
