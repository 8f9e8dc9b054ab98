import random

import pytest
import torch

from batchgen.kernels.prefill_attention import (
    _prefill_attention_launch,
    prefill_attention_ref,
    prefill_attention_triton,
)
from tests.kernels.attention_batch import make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (Hq, Hk, D): GQA, MHA, a group of 7, head_dim not a power of 2; on the GPU also SmolLM2 (group
# 3) and head_dim 256.
HEADS = [(4, 2, 32), (3, 3, 24)] + [
    pytest.param(*h, marks=pytest.mark.gpu)
    for h in [(32, 8, 64), (32, 8, 128), (14, 2, 80), (9, 3, 64), (8, 2, 256)]
]
# (q_len, kv_len): one token, a whole prompt, chunks with a cached prefix, a chunk over two blocks.
CPU_SEQS = [(1, 1), (7, 12), (19, 19), (3, 40), (130, 200)]


def _gpu_seqs():
    rng = random.Random(0)
    seqs = [(1000, 1000), (1, 1), (1, 2048)]  # one long prompt, decodes inside a prefill batch
    for _ in range(40):
        q_len = rng.randint(1, 70)
        seqs.append((q_len, q_len + rng.choice([0, 0, rng.randint(1, 600)])))
    return seqs


def _run(batch, max_q_len, scale, launch=prefill_attention_triton, *config):
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows,
            batch.q_start, batch.q_lens, batch.kv_lens, max_q_len, scale)
    return launch(*args, *config), prefill_attention_ref(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", HEADS)
def test_prefill_attention(device, assert_close, dtype, q_heads, kv_heads, head_dim):
    seqs = CPU_SEQS if device == "cpu" else _gpu_seqs()
    batch = make_batch(seqs, q_heads, kv_heads, head_dim, dtype, device)
    out, ref = _run(batch, max(q for q, _ in seqs), head_dim**-0.5)
    assert_close(out, ref)


@pytest.mark.parametrize("block_m,block_n,num_warps", [(16, 16, 1), (32, 64, 2), (64, 32, 4)])
def test_prefill_attention_block_sizes(device, assert_close, block_m, block_n, num_warps):
    batch = make_batch(CPU_SEQS, 4, 1, 16, torch.float16, device, seed=3)
    out, ref = _run(batch, 130, 0.3, _prefill_attention_launch, block_m, block_n, num_warps, 2)
    assert_close(out, ref)


def test_prefill_attention_max_q_len_is_an_upper_bound(device, assert_close):
    batch = make_batch([(5, 9), (2, 2)], 2, 1, 16, torch.float32, device, seed=4)
    out, ref = _run(batch, 100, 0.25)
    assert_close(out, ref)


def test_reference_padded_batch_equals_one_sequence_at_a_time():
    """The reference runs many short chunks as one padded attention call: same result as the loop."""
    from batchgen.kernels.prefill_attention import _padded_prefill

    batch = make_batch(CPU_SEQS, 4, 2, 32, torch.float32, "cpu", seed=7)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows,
            batch.q_start, batch.q_lens, batch.kv_lens, 130, 0.2)
    one_by_one = torch.cat([
        prefill_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows[i : i + 1],
                              batch.q_start[i : i + 1], batch.q_lens[i : i + 1], batch.kv_lens[i : i + 1], 130, 0.2)
        [batch.q_start[i] : batch.q_start[i] + batch.q_lens[i]]
        for i in range(len(CPU_SEQS))
    ])
    padded = _padded_prefill(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token,
                             *(t.tolist() for t in args[4:8]), 130, 0.2)
    torch.testing.assert_close(padded, one_by_one, atol=1e-5, rtol=1e-5)
