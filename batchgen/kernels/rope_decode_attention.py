"""Rope, the KV store and decode attention in one launch, for decode steps of few sequences (the
engine takes it at one): at one row the three kernels it replaces are latency, not bytes.

Program (kv head g, split c, sequence i), for the G = Hq / Hk query heads of g (L = kv_lens[i]):
  before the PDL wait   the slots and cached K/V of the split's keys before position L - 1 (written
                        by earlier steps), BLOCK_N of them, and the step's index arrays;
  after it              q and the new k rotated in registers (as kernels/rope_store_kv.py rounds; q,
                        k and v are left as they are), k and v stored at out_slots[i] by the split
                        that holds L - 1, then kernels/decode_attention.py's stage 1 for the split;
  the last split of (i, g) to finish (a counter per (i, g), acq_rel) merges the C parts as that
  file's stage 2 and sets the counter back to 0.
q [B, Hq, D], k and v [B, Hk, D] come with their own strides (views into the qkv product, or Qwen3's
q/k norm outputs), read after the wait.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchgen.kernels.decode_attention import decode_attention_ref, pick_num_splits
from batchgen.kernels.device import num_sms, pdl_launch_args, wait_for_prior_kernels
from batchgen.kernels.rope_store_kv import rope_store_kv_ref

BLOCK_N = 64  # keys a step; a split of at most this many keys is read whole before the wait
MAX_SPLITS = 64  # (the merge's BLOCK_C)
# About one program an SM (decode_attention's split kernel takes two): fewer parts for the last one to merge
PROGRAMS_PER_SM = 1
MAX_COUNTERS = 4096  # (sequence, kv head) pairs the persistent counters cover
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _cached_keys(k_cache_ptr, v_cache_ptr, token_row, t0, end, last, cache_stride_s, head_offs,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions t = t0 + [0, BLOCK_N) and the halves of their cached K and V (zeros at t >= end and at
    the new position `last`, which is not in the cache yet)."""
    t = t0 + tl.arange(0, BLOCK_N)
    cached = (t < end) & (t < last)
    slots = tl.load(token_row + t, mask=cached, other=0).to(tl.int64)
    offs = slots[:, None] * cache_stride_s + head_offs + tl.arange(0, HALF)[None, :]
    mask = cached[:, None]
    return (t,
            tl.load(k_cache_ptr + offs, mask=mask, other=0.0), tl.load(k_cache_ptr + offs + HALF, mask=mask, other=0.0),
            tl.load(v_cache_ptr + offs, mask=mask, other=0.0), tl.load(v_cache_ptr + offs + HALF, mask=mask, other=0.0))


@triton.jit
def _rotate(x1, x2, cos, sin, dtype):
    """NeoX rope on the halves of heads, fp32, rounded to dtype."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


# num_splits follows max_kv_len in eager steps: not specialized (one compile for every length)
# index arrays not specialized on alignment (kernels/__init__.py)
@triton.jit(do_not_specialize=["qk_scale", "num_splits"],
            do_not_specialize_on_alignment=["rows_ptr", "kv_lens_ptr", "positions_ptr", "out_slots_ptr"])
def _rope_decode_attention_kernel(
    q_ptr,  # [B, Hq, D] before rope, read only
    q_stride_b,  # elements between two sequences of q
    q_stride_h,  # elements between two heads of q
    k_ptr,  # [B, Hk, D] the new keys before rope, read only
    k_stride_b,  # elements between two sequences of k
    k_stride_h,  # elements between two heads of k
    v_ptr,  # [B, Hk, D] the new values, read only
    v_stride_b,  # elements between two sequences of v
    v_stride_h,  # elements between two heads of v
    k_cache_ptr, v_cache_ptr,  # [num_slots, Hk, D]
    cache_stride_s, cache_stride_h,
    req_to_token_ptr, req_to_token_stride,
    rows_ptr, kv_lens_ptr, positions_ptr, out_slots_ptr,  # [B] each
    cos_sin_ptr,  # [P, D] fp32: cos in [0, D/2), sin in [D/2, D)
    part_o_ptr,  # [B, Hq, C, D] fp32
    part_lse_ptr,  # [B, Hq, C] fp32
    counters_ptr,  # [B, Hk] int32, 0 between launches
    out_ptr,  # [B, Hq, D]
    num_q_heads, num_kv_heads, num_splits, qk_scale,
    GROUP: tl.constexpr,  # G
    BLOCK_G: tl.constexpr,  # next power of 2 >= G, at least 16 (tl.dot)
    MERGE_G: tl.constexpr,  # next power of 2 >= G
    HALF: tl.constexpr,  # D / 2 (a power of 2, at least 16)
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next power of 2 >= MAX_SPLITS, whatever C (one compile)
    PDL: tl.constexpr,
):
    g = tl.program_id(0)
    c = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, HALF)
    # ---- before the wait: the step's indices and the cached keys (see the module's doc)
    kv_len = tl.load(kv_lens_ptr + seq)
    last = kv_len - 1
    span = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = c * span
    end = tl.minimum(start + span, kv_len)
    token_row = req_to_token_ptr + tl.load(rows_ptr + seq).to(tl.int64) * req_to_token_stride
    head_offs = g.to(tl.int64) * cache_stride_h
    t, k1, k2, v1, v2 = _cached_keys(k_cache_ptr, v_cache_ptr, token_row, start, end, last, cache_stride_s,
                                     head_offs, HALF, BLOCK_N)
    pos = tl.load(positions_ptr + seq).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + d)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + d)
    wait_for_prior_kernels(PDL)
    # ---- q and the new k / v
    j = tl.arange(0, BLOCK_G)
    head_ok = j < GROUP
    heads = g * GROUP + j
    q_ptrs = q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :]
    q1, q2 = _rotate(tl.load(q_ptrs, mask=head_ok[:, None], other=0.0),
                     tl.load(q_ptrs + HALF, mask=head_ok[:, None], other=0.0), cos[None, :], sin[None, :], dtype)
    k_new_ptr = k_ptr + seq * k_stride_b + g * k_stride_h
    v_new_ptr = v_ptr + seq * v_stride_b + g * v_stride_h
    new_k1, new_k2 = _rotate(tl.load(k_new_ptr + d), tl.load(k_new_ptr + HALF + d), cos, sin, dtype)
    new_v1 = tl.load(v_new_ptr + d)
    new_v2 = tl.load(v_new_ptr + HALF + d)
    if (start <= last) & (last < end):
        slot = tl.load(out_slots_ptr + seq).to(tl.int64) * cache_stride_s + head_offs
        tl.store(k_cache_ptr + slot + d, new_k1.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + slot + HALF + d, new_k2.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + slot + d, new_v1.to(v_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + slot + HALF + d, new_v2.to(v_cache_ptr.dtype.element_ty))
    # ---- stage 1 over the split, the first BLOCK_N keys already loaded
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        if t0 != start:
            t, k1, k2, v1, v2 = _cached_keys(k_cache_ptr, v_cache_ptr, token_row, t0, end, last, cache_stride_s,
                                             head_offs, HALF, BLOCK_N)
        is_new = (t == last)[:, None]
        kt1 = tl.where(is_new, new_k1[None, :], k1)
        kt2 = tl.where(is_new, new_k2[None, :], k2)
        s = tl.dot(q1, tl.trans(kt1)) + tl.dot(q2, tl.trans(kt2))
        s = tl.where((t < end)[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        vt1 = tl.where(is_new, new_v1[None, :], v1)
        vt2 = tl.where(is_new, new_v2[None, :], v2)
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(dtype), vt1)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(dtype), vt2)
        m = m_new
    has_keys = total > 0  # (a split past the context: lse_c = -inf, o_c = 0)
    safe_total = tl.where(has_keys, total, 1.0)
    part = (seq * num_q_heads + heads) * num_splits + c
    tl.store(part_lse_ptr + part, tl.where(has_keys, m + tl.log2(safe_total), float("-inf")), mask=head_ok)
    tl.store(part_o_ptr + part[:, None] * (2 * HALF) + d[None, :], acc1 / safe_total[:, None], mask=head_ok[:, None])
    tl.store(part_o_ptr + part[:, None] * (2 * HALF) + HALF + d[None, :], acc2 / safe_total[:, None],
             mask=head_ok[:, None])
    # ---- the last split of (sequence, kv head) merges
    tl.debug_barrier()  # every thread's part is written before the count says so
    counter = counters_ptr + seq * num_kv_heads + g
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.atomic_xchg(counter, 0)
        tl.debug_barrier()
        mj = tl.arange(0, MERGE_G)
        merge_heads = g * GROUP + mj
        cs = tl.arange(0, BLOCK_C)
        ok = (mj < GROUP)[:, None] & (cs < num_splits)[None, :]
        rows = (seq * num_q_heads + merge_heads[:, None]) * num_splits + cs[None, :]  # [MERGE_G, BLOCK_C]
        lses = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(lses, axis=1)
        weights = tl.exp2(lses - tl.where(top > float("-inf"), top, 0.0)[:, None])
        weights = weights / tl.maximum(tl.sum(weights, axis=1), 1e-30)[:, None]  # (padded heads: 0, not 0 / 0)
        out_rows = out_ptr + (seq * num_q_heads + merge_heads)[:, None] * (2 * HALF) + d[None, :]
        for h in tl.static_range(2):  # one half of D at a time (registers)
            o = tl.load(part_o_ptr + rows[:, :, None] * (2 * HALF) + h * HALF + d[None, None, :],
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            merged = tl.sum(o * weights[:, :, None], axis=1)
            tl.store(out_rows + h * HALF, merged.to(out_ptr.dtype.element_ty), mask=(mj < GROUP)[:, None])


def _counters(device: torch.device) -> torch.Tensor:
    """The device's split counters, allocated once (outside any CUDA graph: at warm-up). Launches on one
    stream only: kernels on two streams of a device at once would share them."""
    if device not in _COUNTERS:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "allocate the split counters before capturing a graph (a captured zero-fill never runs)"
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def rope_decode_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
    out_slots: torch.Tensor, cos_sin_cache: torch.Tensor, max_kv_len: int, scale: float, sms: int,
) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hk, D] (before rope; read only) -> attention output [B, Hq, D]; stores the
    rotated k and v at out_slots. sms: the GPU's SM count (any small number on the CPU interpreter)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    assert k.shape == v.shape == (num_seqs, num_kv_heads, head_dim) and k_cache.shape[1:] == (num_kv_heads, head_dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "the head_dim axis must be contiguous"
    assert head_dim % 32 == 0 and head_dim & (head_dim - 1) == 0 and num_q_heads == group * num_kv_heads
    assert q.dtype in (torch.float16, torch.bfloat16), "16-bit only: the dots run in their default precision"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == q.dtype
    assert k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1] == head_dim
    assert num_seqs * num_kv_heads <= MAX_COUNTERS
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    splits = min(pick_num_splits(num_seqs, num_kv_heads, max_kv_len, BLOCK_N, sms, PROGRAMS_PER_SM), MAX_SPLITS)
    f32 = dict(dtype=torch.float32, device=q.device)
    part_o = torch.empty((num_seqs, num_q_heads, splits, head_dim), **f32)
    part_lse = torch.empty((num_seqs, num_q_heads, splits), **f32)
    _rope_decode_attention_kernel[(num_kv_heads, splits, num_seqs)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), req_to_token,
        req_to_token.stride(0), rows, kv_lens, positions, out_slots, cos_sin_cache, part_o, part_lse,
        _counters(q.device), out, num_q_heads, num_kv_heads, splits, scale * math.log2(math.e),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), MERGE_G=triton.next_power_of_2(group),
        HALF=head_dim // 2, BLOCK_N=BLOCK_N, BLOCK_C=triton.next_power_of_2(MAX_SPLITS), num_warps=4,
        **pdl_launch_args(q.device),
    )
    return out


def rope_decode_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
    out_slots: torch.Tensor, cos_sin_cache: torch.Tensor, max_kv_len: int, scale: float,
) -> torch.Tensor:
    """The ops it fuses: rope_store_kv, then decode attention (on copies of q and k: the inputs are
    left as they are, as the kernel leaves them)."""
    q, k = q.clone(), k.clone()
    rope_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_slots)
    return decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, kv_lens, max_kv_len, scale)


def rope_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
    out_slots: torch.Tensor, cos_sin_cache: torch.Tensor, max_kv_len: int, scale: float,
) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hk, D] before rope (not modified) -> attention output [B, Hq, D]; stores the
    rotated k and v at out_slots."""
    if q.is_cuda:
        return rope_decode_attention_triton(q, k, v, k_cache, v_cache, req_to_token, rows, kv_lens, positions,
                                            out_slots, cos_sin_cache, max_kv_len, scale, num_sms(q.device))
    return rope_decode_attention_ref(q, k, v, k_cache, v_cache, req_to_token, rows, kv_lens, positions, out_slots,
                                     cos_sin_cache, max_kv_len, scale)
