import random

import pytest
import torch

from batchgen.kernels.unified_attention import (
    _unified_attention_launch,
    unified_attention_ref,
    unified_attention_triton,
)
from tests.kernels.attention_batch import make_batch, q_bounds

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (Hq, Hk, D): GQA, a group of 7 with head_dim not a power of 2, MHA; on the GPU llama-3.2-1b,
# llama-3.1-8b, MHA, Qwen2.5-0.5b (14/2), head_dim 80 and 256, a group of 16.
HEADS = [(4, 2, 32), (7, 1, 24), (3, 3, 16)] + [
    pytest.param(*h, marks=pytest.mark.gpu)
    for h in [(32, 8, 64), (32, 8, 128), (16, 16, 64), (14, 2, 64), (14, 2, 80), (8, 2, 256), (32, 2, 64)]
]
# (q_len, kv_len) per sequence; (0, 0) is a padding sequence.
CPU_BATCHES = {
    "decode-only": [(1, 1), (1, 7), (1, 13), (1, 64), (1, 97)],
    "prefill-only": [(19, 19), (1, 1), (40, 40), (5, 5)],
    "mixed": [(1, 5), (1, 97), (1, 1), (7, 12), (19, 19), (3, 40), (33, 60), (17, 17)],
    "padding": [(1, 9), (0, 0), (18, 18), (0, 0), (1, 3), (0, 0), (0, 0)],
}


def _gpu_batches():
    rng = random.Random(0)
    decodes = [(1, rng.randint(1, 2000)) for _ in range(60)]
    chunks = []
    for _ in range(12):
        q_len = rng.randint(1, 300)
        chunks.append((q_len, q_len + rng.choice([0, rng.randint(1, 1500)])))
    return {
        "decode-only": decodes + [(1, 4097)],
        "prefill-only": [(1000, 1000), (1, 1)] + chunks,
        "mixed": decodes[:30] + [(0, 0)] * 3 + chunks + [(256, 1280), (1, 8000)] + [(0, 0)] * 5,
    }


def _args(batch, scale):
    return (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, q_bounds(batch),
            batch.kv_lens, scale)


def _build(seqs, heads, dtype, device, pad_tokens=3, **kwargs):
    """A batch whose padding sequences carry garbage lengths and rows (never read) and whose q has
    NaN rows past the last sequence's."""
    q_heads, kv_heads, head_dim = heads
    batch = make_batch(seqs, q_heads, kv_heads, head_dim, dtype, device, pad_tokens=pad_tokens, **kwargs)
    padding = (batch.q_lens == 0).nonzero().flatten()
    batch.kv_lens[padding] = 5
    return batch


def _check(out, ref, args, assert_close):
    used = int(args[5][-1])
    assert torch.isfinite(out[:used]).all()
    assert_close(out[:used], ref[:used])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("kind", ["decode-only", "prefill-only", "mixed", "padding"])
def test_unified_attention(device, assert_close, dtype, q_heads, kv_heads, head_dim, kind):
    batches = CPU_BATCHES if device == "cpu" else _gpu_batches()
    if kind not in batches:
        pytest.skip(f"no {kind} batch on {device}")
    batch = _build(batches[kind], (q_heads, kv_heads, head_dim), dtype, device)
    assert batch.q.stride(0) == (q_heads + 2 * kv_heads) * head_dim  # a view into a fused qkv
    args = _args(batch, head_dim**-0.5)
    _check(unified_attention_triton(*args), unified_attention_ref(*args), args, assert_close)


@pytest.mark.parametrize(
    "block_m,small_m,block_n,num_warps",
    [(16, 16, 16, 1), (32, 16, 16, 2), (64, 16, 32, 4), (64, 64, 16, 4), (128, 32, 64, 4)],
)
def test_unified_attention_tile_sizes(device, assert_close, block_m, small_m, block_n, num_warps):
    """Chunks longer and shorter than a q block (BLOCK_M // G tokens), tails that take the small
    tile, a group that does not divide the tile (G = 3)."""
    for heads, seed in [((6, 2, 16), 1), ((3, 1, 16), 2)]:
        batch = _build(CPU_BATCHES["mixed"] + [(0, 0)], heads, torch.float32, device, seed=seed)
        args = _args(batch, 0.3)
        out = _unified_attention_launch(*args, block_m, small_m, block_n, num_warps, 1)
        _check(out, unified_attention_ref(*args), args, assert_close)


def test_unified_attention_matches_prefill_and_decode_references(device, assert_close):
    """The reference agrees with the decode and prefill kernels' references on a mixed batch."""
    from batchgen.kernels.decode_attention import decode_attention_ref
    from batchgen.kernels.prefill_attention import prefill_attention_ref

    seqs = [(1, 5), (1, 30), (7, 12), (19, 19)]
    b = make_batch(seqs, 4, 2, 16, torch.float32, "cpu", seed=4)
    out = unified_attention_ref(*_args(b, 0.25))
    dec = decode_attention_ref(b.q[:2], b.k_cache, b.v_cache, b.req_to_token, b.req_rows[:2], b.kv_lens[:2], 30, 0.25)
    pre = prefill_attention_ref(b.q[2:], b.k_cache, b.v_cache, b.req_to_token, b.req_rows[2:],
                                b.q_start[2:] - 2, b.q_lens[2:], b.kv_lens[2:], 19, 0.25)
    assert_close(out, torch.cat((dec, pre)))


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 8, 64), (14, 2, 64), (32, 8, 128)])
def test_unified_attention_in_cuda_graph(device, assert_close, q_heads, kv_heads, head_dim):
    """Captured with one step's metadata, replayed with another's (other lengths, slots and mix of
    decodes and chunks; same T and B): the same output as an eager launch and the reference."""
    num_tokens, table_len, num_slots = 700, 4096, 20000
    steps = [
        [(1, 300), (1, 1), (1, 2000), (200, 200), (64, 1100), (0, 0), (0, 0)],
        [(1, 17), (300, 3000), (1, 4000), (1, 5), (0, 0), (0, 0), (0, 0)],
        [(1, 1)] * 5 + [(0, 0)] * 2,
        [(100, 100)] * 7,
    ]
    heads = (q_heads, kv_heads, head_dim)

    def build(seqs, seed):
        pad = num_tokens - sum(q for q, _ in seqs)
        return _build(seqs, heads, torch.bfloat16, device, pad_tokens=pad, seed=seed,
                      table_len=table_len, num_slots=num_slots)

    static = build(steps[0], 0)
    args = _args(static, head_dim**-0.5)
    q_start = args[5]
    unified_attention_triton(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = unified_attention_triton(*args)
    for seed, seqs in enumerate(steps):
        new = build(seqs, seed)
        for name in ("k_cache", "v_cache", "req_to_token", "req_rows", "kv_lens"):
            getattr(static, name).copy_(getattr(new, name))
        static.q.copy_(new.q)
        q_start.copy_(q_bounds(new))
        graph.replay()
        _check(out, unified_attention_ref(*args), args, assert_close)
        used = int(q_start[-1])
        assert torch.equal(out[:used], unified_attention_triton(*args)[:used])


def _probe_rows(layout, dtype, device, heads, probe_len=45):
    """Run unified attention (batch_invariant) on each launch of `layout` -> {position: output row} of
    the probe sequence (table row 0). A launch is [(table row, first position, queries)]; row 0 is the
    probe, whose queries are fixed per position; the other rows' queries are random. One pool for all."""
    q_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(7)
    rows, width = 5, max(64, probe_len + 5)
    slots = torch.randperm(rows * width, generator=gen).int().view(rows, width)
    k_cache = torch.randn(rows * width, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(rows * width, kv_heads, head_dim, generator=gen).to(device, dtype)
    probe_q = torch.randn(probe_len, q_heads, head_dim, generator=gen)
    got = {}
    for launch in layout:
        qs = [probe_q[first : first + n] if row == 0 else torch.randn(n, q_heads, head_dim, generator=gen)
              for row, first, n in launch]
        q = torch.cat(qs).to(device, dtype)
        q_start = torch.tensor([0] + [n for _, _, n in launch]).cumsum(0).int().to(device)
        seq_rows = torch.tensor([row for row, _, _ in launch]).int().to(device)
        kv_lens = torch.tensor([first + n for _, first, n in launch]).int().to(device)
        out = unified_attention_triton(q, k_cache, v_cache, slots.to(device), seq_rows, q_start, kv_lens, 0.25,
                                       batch_invariant=True)
        for (row, first, n), start in zip(launch, q_start.tolist()):
            if row == 0:
                got.update({first + j: out[start + j] for j in range(n)})
    return got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 16)] + [pytest.param(h, marks=pytest.mark.gpu)
                                                  for h in [(32, 8, 64), (14, 2, 64), (32, 8, 128)]])
def test_batch_invariant_rows_depend_on_their_sequence_alone(device, dtype, heads):
    """--batch-invariant: a query's output bits are the same whether its prompt runs whole, chunked at
    another boundary, beside other sequences (decodes and chunks), or as a decode of one token (16-bit:
    an fp32 model on a GPU is not covered)."""
    n = 150  # keys in several BLOCK_N blocks: chunks start inside, at and past block boundaries
    whole = _probe_rows([[(0, 0, n)]], dtype, device, heads, n)
    layouts = {
        "chunked": [[(0, 0, 17)], [(0, 17, 47)], [(0, 64, 70)], [(0, 134, 16)]],
        "chunked in a batch": [[(1, 10, 1), (2, 0, 30), (0, 0, 5)], [(3, 3, 20), (0, 5, 100), (1, 11, 1)],
                               [(0, 105, 45), (4, 40, 2)]],
        "decodes": [[(0, 0, n - 5)]] + [[(1, 20 + p, 1), (2, 3, 9)][: p % 3] + [(0, p, 1)] for p in range(n - 5, n)],
        "cached prefix": [[(0, 129, 21)], [(0, 0, 129)]],  # (the pool already holds the prefix's K/V)
    }
    for name, layout in layouts.items():
        got = _probe_rows(layout, dtype, device, heads, n)
        assert sorted(got) == list(range(n)), name
        changed = [p for p in range(n) if not torch.equal(got[p], whole[p])]
        assert not changed, f"{name}: positions {changed} differ from the whole prompt's"
