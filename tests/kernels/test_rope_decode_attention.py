import pytest
import torch

from batchgen.kernels.rope_decode_attention import (
    _counters,
    rope_decode_attention_ref,
    rope_decode_attention_triton,
)
from tests.kernels.test_rotary import _cos_sin_cache

# (q heads, kv heads, head_dim, context lengths, SMs): a split of several key blocks (few SMs: 2 splits
# of 3 blocks at about a program an SM), one of a block, several sequences with a context of 1 among them,
# GQA groups of 1, 2 and 3 (not a power of 2); on the GPU llama-3.2-1b, qwen2.5-0.5b and SmolLM2 (groups of
# 3) shapes at one row, and plain MHA.
SHAPES = [(4, 2, 32, [300], 4), (2, 1, 64, [70], 132), (6, 2, 32, [5, 1, 131], 8), (3, 3, 32, [64], 8)] + [
    pytest.param(*s, marks=pytest.mark.gpu) for s in [(32, 8, 64, [1100], 132), (14, 2, 64, [900], 132),
                                                      (32, 8, 64, [5000], 132), (9, 3, 64, [700], 132),
                                                      (8, 8, 64, [300], 132)]
]


def _new_qkv(layout, num_seqs, q_heads, kv_heads, head_dim, dtype, device, gen):
    """q [B, Hq, D], k and v [B, Hk, D] before rope. "views": strided views into one qkv product, as
    Llama's layer makes them; "separate": tensors of their own (as Qwen3's q/k norms give them), here
    with awkward strides: q a slice of wider heads, k's heads further apart than its sequences (and
    not at the buffer's start), v every third head of a buffer."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if layout == "views":
        qkv = randn(num_seqs, (q_heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (q.view(num_seqs, q_heads, head_dim), k.view(num_seqs, kv_heads, head_dim),
                v.view(num_seqs, kv_heads, head_dim))
    q = randn(num_seqs + 1, q_heads, head_dim + 24)[1:, :, 8:8 + head_dim]
    k = randn(kv_heads, num_seqs + 2, head_dim).transpose(0, 1)[1:-1]
    v = randn(num_seqs, kv_heads, 3, head_dim)[:, :, 1]
    return q, k, v


def _case(layout, q_heads, kv_heads, head_dim, lens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_seqs, width = len(lens), max(lens) + 3
    num_slots = sum(lens) + 11
    q, k, v = _new_qkv(layout, num_seqs, q_heads, kv_heads, head_dim, dtype, device, gen)
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    req_to_token = torch.zeros(num_seqs + 2, width, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen).int()
    rows = torch.arange(num_seqs, dtype=torch.int32) + 1  # row 0 unused
    taken = 0
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = perm[taken:taken + n]
        taken += n
    out_slots = torch.stack([req_to_token[r, n - 1] for r, n in zip(rows.tolist(), lens)]).long()
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    positions = kv_lens.long() - 1
    return [q, k, v, k_cache, v_cache, req_to_token.to(device), rows.to(device), kv_lens.to(device),
            positions.to(device), out_slots.to(device), _cos_sin_cache(width + 8, head_dim, device), width,
            head_dim**-0.5]


@pytest.mark.parametrize("layout", ["views", "separate"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,lens,sms", SHAPES)
def test_rope_decode_attention_matches_rope_store_then_attention(device, assert_close, q_heads, kv_heads, head_dim,
                                                                 lens, sms, layout):
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # (the interpreter has no bf16 arithmetic)
    args = _case(layout, q_heads, kv_heads, head_dim, lens, dtype, device)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    inputs_before = [x.clone() for x in args[:3]]
    want = rope_decode_attention_ref(*ref_args)
    # the first launch finds the new positions' slots holding other values (it must not read them), the
    # second its own stores there; both give the reference's output, and leave the counters at 0
    for _ in range(2):
        out = rope_decode_attention_triton(*args, sms=sms)
        assert_close(out, want, scale=2)
    k_cache, v_cache, ref_k, ref_v, out_slots = args[3], args[4], ref_args[3], ref_args[4], args[9]
    written = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    written[out_slots] = True
    assert torch.equal(k_cache[~written], ref_k[~written]) and torch.equal(v_cache, ref_v)
    assert_close(k_cache[written], ref_k[written])
    for x, before in zip(args[:3], inputs_before):  # q, k, v are read, not rotated in place
        assert torch.equal(x, before)
    assert int(_counters(out.device).abs().sum()) == 0


def test_about_one_program_an_sm():
    """The one launch takes about one program an SM (the split kernel two), no more splits than the
    context has key blocks: llama-3.2-1b's 8 kv heads on an H200's 132 SMs take 17 splits, not 33."""
    from batchgen.kernels.decode_attention import pick_num_splits
    from batchgen.kernels.rope_decode_attention import BLOCK_N, PROGRAMS_PER_SM
    assert pick_num_splits(1, 8, 4096, BLOCK_N, 132, PROGRAMS_PER_SM) == 17
    assert pick_num_splits(1, 8, 4096, BLOCK_N, 132) == 33
    assert pick_num_splits(1, 8, 600, BLOCK_N, 132, PROGRAMS_PER_SM) == 10
    assert pick_num_splits(4, 8, 4096, BLOCK_N, 132, PROGRAMS_PER_SM) == 5
