import pytest
import torch

from batchgen.kernels.decode_attention import (
    TILE_HEAD_DIM_64,
    TILE_HEAD_DIM_64_DENSE,
    TILE_HEAD_DIM_64_DENSEST,
    TILE_HEAD_DIM_128,
    TILE_HEAD_DIM_128_SPARSE,
    TILE_SMALL,
    _decode_attention_launch,
    decode_attention_cpu,
    decode_attention_ref,
    decode_attention_triton,
    dense_tile_batch_sizes,
    pick_tile,
)
from tests.kernels.attention_batch import make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (Hq, Hk, D): GQA, MHA, a group of 7, head_dim not a power of 2; on the GPU also groups of 8, 32,
# 3 (SmolLM2) and head_dim 256.
HEADS = [(4, 2, 32), (7, 1, 24), (2, 2, 16)] + [
    pytest.param(*h, marks=pytest.mark.gpu)
    for h in [
        (32, 8, 64), (32, 8, 128), (14, 2, 80), (64, 8, 128), (32, 1, 64), (9, 3, 64), (8, 2, 256)
    ]
]
CPU_KV_LENS = [1, 7, 13, 64, 97]


def _gpu_kv_lens():
    gen = torch.Generator().manual_seed(0)
    return [1, 4097, 2] + torch.randint(1, 2000, (61,), generator=gen).tolist()


def _args(batch, max_kv_len, scale):
    return (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows,
            batch.kv_lens, max_kv_len, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", HEADS)
def test_decode_attention(device, assert_close, dtype, q_heads, kv_heads, head_dim):
    kv_lens = CPU_KV_LENS if device == "cpu" else _gpu_kv_lens()
    batch = make_batch([(1, n) for n in kv_lens], q_heads, kv_heads, head_dim, dtype, device)
    args = _args(batch, max(kv_lens) + 3, head_dim**-0.5)
    assert_close(decode_attention_triton(*args), decode_attention_ref(*args))


@pytest.mark.interpreter_bf16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 32), (7, 1, 24), (2, 2, 16), (9, 3, 64), (4, 4, 32)])
def test_decode_attention_cpu_path(assert_close, dtype, q_heads, kv_heads, head_dim):
    """The engine's CPU path (batched matmuls) against the reference, on CPU whatever the machine; its
    output is contiguous (the attention layer views it). In 16-bit the scores are rounded once more than
    the reference's (fp32 inside SDPA)."""
    batch = make_batch([(1, n) for n in CPU_KV_LENS], q_heads, kv_heads, head_dim, dtype, "cpu", seed=3)
    args = _args(batch, max(CPU_KV_LENS) + 3, head_dim**-0.5)
    out = decode_attention_cpu(*args)
    assert out.is_contiguous()
    assert_close(out, decode_attention_ref(*args), scale=1 if dtype == torch.float32 else 2)


@pytest.mark.parametrize(
    "num_splits,block_n,num_warps", [(1, 16, 1), (3, 16, 2), (2, 64, 4), (7, 32, 4), (40, 16, 1), (2, 128, 4)]
)
def test_decode_attention_splits(device, assert_close, num_splits, block_n, num_warps):
    batch = make_batch([(1, n) for n in CPU_KV_LENS], 8, 2, 32, torch.float32, device, seed=5)
    args = _args(batch, 97, 0.2)
    out = _decode_attention_launch(*args, num_splits, block_n, num_warps, 2)
    assert_close(out, decode_attention_ref(*args))


def test_decode_attention_empty_context_gives_zeros(device, assert_close):
    batch = make_batch([(1, 5), (1, 1), (1, 9)], 4, 2, 16, torch.float32, device, seed=6)
    batch.kv_lens[1] = 0
    args = _args(batch, 9, 0.25)
    out = decode_attention_triton(*args)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = decode_attention_ref(*args)
    assert_close(out[[0, 2]], ref[[0, 2]])


@pytest.mark.gpu
def test_decode_attention_in_cuda_graph(device, assert_close):
    """No host synchronisation: the launch captures, and replays follow new lengths and slots."""
    max_kv_len = 2048  # the width of the token table, as when the engine captures a graph
    batch = make_batch([(1, n) for n in [300, 1, 77, 1024]], 32, 8, 128, torch.bfloat16, device,
                       table_len=max_kv_len)
    args = _args(batch, max_kv_len, 128**-0.5)
    decode_attention_triton(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(*args)
    for step in range(3):
        batch.kv_lens.sub_(step)  # shorter contexts; a length of 0 is never reached here
        batch.kv_lens.clamp_(min=1)
        batch.q.normal_()
        graph.replay()
        assert_close(out, decode_attention_ref(*args))


def test_the_dense_tiles_from_eight_and_twelve_programs_an_sm():
    """Head_dim 64: the 64-key tile once sequences x kv heads reach 8 an SM (llama-3.2-1b on 132 SMs:
    from 132 sequences), a warp a program from 12 an SM (198 sequences), the 128-key tile below 8; fp32
    and other head sizes keep theirs."""
    bf16 = torch.bfloat16
    assert pick_tile(bf16, 64, 131 * 8, 132) == TILE_HEAD_DIM_64
    assert pick_tile(bf16, 64, 132 * 8, 132) == TILE_HEAD_DIM_64_DENSE
    assert pick_tile(bf16, 64, 197 * 8, 132) == TILE_HEAD_DIM_64_DENSE
    assert pick_tile(bf16, 64, 198 * 8, 132) == TILE_HEAD_DIM_64_DENSEST == (64, 1, 3)
    assert pick_tile(bf16, 128, 256 * 8, 132) == TILE_HEAD_DIM_128
    assert pick_tile(torch.float32, 64, 256 * 8, 132) == TILE_SMALL


def test_head_dim_128_takes_the_128_key_tile_below_six_programs_an_sm():
    """Head_dim 128, 16-bit pool: the 128-key, 2-stage tile below 6 programs an SM (qwen3-30b-a3b's 2 KV heads
    a GPU at TP=2: up to 395 sequences on 132 SMs), the 64-key tile from there; an fp8 pool keeps the 64-key tile
    below its own dense tile."""
    bf16 = torch.bfloat16
    assert pick_tile(bf16, 128, 256 * 2, 132) == TILE_HEAD_DIM_128_SPARSE == (128, 4, 2)
    assert pick_tile(bf16, 128, 395 * 2, 132) == TILE_HEAD_DIM_128_SPARSE
    assert pick_tile(bf16, 128, 396 * 2, 132) == TILE_HEAD_DIM_128
    assert pick_tile(bf16, 96, 1, 132) == TILE_HEAD_DIM_128_SPARSE
    assert pick_tile(bf16, 128, 1, 132, torch.float8_e4m3fn) == TILE_HEAD_DIM_128
    assert dense_tile_batch_sizes(2, 132, head_dim=128) == [396]
    assert dense_tile_batch_sizes(8, 132, head_dim=128) == [99]


@pytest.mark.parametrize("kv_heads,sms", [(8, 132), (2, 132), (8, 78), (3, 114)])
def test_dense_tile_batch_sizes_are_where_pick_tile_changes(kv_heads, sms):
    """Warm-up's decode steps (executor/warmup.py) are the fewest sequences at which each dense tile is
    taken: one sequence fewer takes the tile before it (llama-3.2-1b on an H200: 132 and 198)."""
    assert dense_tile_batch_sizes(8, 132) == [132, 198]
    bf16 = torch.bfloat16
    dense, densest = dense_tile_batch_sizes(kv_heads, sms)
    for n, tile, before in [(dense, TILE_HEAD_DIM_64_DENSE, TILE_HEAD_DIM_64),
                            (densest, TILE_HEAD_DIM_64_DENSEST, TILE_HEAD_DIM_64_DENSE)]:
        assert pick_tile(bf16, 64, n * kv_heads, sms) == tile
        assert pick_tile(bf16, 64, (n - 1) * kv_heads, sms) == before


@pytest.mark.gpu
@pytest.mark.parametrize("per_sm,tile", [(8, TILE_HEAD_DIM_64_DENSE), (12, TILE_HEAD_DIM_64_DENSEST)])
def test_decode_attention_at_the_dense_tiles(device, assert_close, per_sm, tile):
    """Enough sequences for the 64-key tiles (8 and 12 programs an SM), contexts of 1 to 2,000 keys in
    random order, so the schedule reorders them."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_seqs = per_sm * sms // 8 + 3  # x 8 kv heads: per_sm programs an SM and more
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 2000, (num_seqs,), generator=gen).tolist()
    batch = make_batch([(1, n) for n in lens], 32, 8, 64, torch.bfloat16, device, seed=2, table_len=2048)
    args = _args(batch, 2048, 64**-0.5)
    assert pick_tile(torch.bfloat16, 64, num_seqs * 8, sms) == tile
    assert_close(decode_attention_triton(*args), decode_attention_ref(*args))
