"""An fp8 (e4m3) KV pool under a 16/32-bit model (--kv-cache-dtype fp8): the stores round and
saturate as cast_for_cache does, and every attention kernel reads the pool as its torch reference
does (both widen the same fp8 values, so the dtype's usual tolerance holds).

Under the Triton interpreter (CI) the stores are checked on values that need no rounding, and the
rotated keys of rope + store not at all: the interpreter itself rounds some values to fp8 wrongly
(see INTERPRETED). The GPU checks the rounding."""
import pytest
import torch

from batchgen.kernels.decode_attention import (
    TILE_FP8_POOL_DENSE,
    TILE_HEAD_DIM_128,
    _decode_attention_launch,
    decode_attention_cpu,
    decode_attention_ref,
    decode_attention_triton,
    dense_tile_batch_sizes,
    pick_tile,
)
from batchgen.kernels.kv_dtype import FP8_E4M3_MAX, cast_for_cache
from batchgen.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from batchgen.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton
from batchgen.kernels.unified_attention import unified_attention_ref, unified_attention_triton
from tests.kernels.attention_batch import make_batch, q_bounds
from tests.kernels.test_rope_store_kv import _inputs as rope_inputs

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the model's; bf16 runs on the GPU only
# Triton's interpreter (3.9) widens fp8 right but narrows wrongly at powers of two and subnormals
# (31.5 -> 16, 2**-5 -> 2**-6): under it the stores get values that need no rounding.
INTERPRETED = not torch.cuda.is_available()


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def _store_values(x: torch.Tensor) -> torch.Tensor:
    """x itself on the GPU; under the interpreter, the nearest fp8 normals with a mantissa (past
    fp8's range values stay there: they saturate to 448 = 1.75 * 2**8)."""
    if not INTERPRETED:
        return x
    y = cast_for_cache(x, FP8).float()
    mantissa, _ = torch.frexp(y)
    plain = (y.abs() >= 2**-6) & (mantissa.abs() != 0.5) & (y.abs() < FP8_E4M3_MAX)
    return torch.where(plain, y, torch.where(x.abs() >= FP8_E4M3_MAX, x, torch.full_like(x, 0.75)))


def test_cast_for_cache_saturates_instead_of_nan():
    x = torch.tensor([1000.0, -1e6, 447.0, 0.3, -0.001, float("inf")])
    out = cast_for_cache(x, FP8).float()
    assert torch.equal(out[:3], torch.tensor([FP8_E4M3_MAX, -FP8_E4M3_MAX, 448.0]))
    assert torch.isfinite(out).all() and out[5] == FP8_E4M3_MAX
    assert torch.equal(cast_for_cache(x, torch.float32), x)  # other pools: a plain cast


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_into_fp8_pool(device, dtype):
    """rope_store_kv's stores at position 0 (cos 1, sin 0: k unrotated): k and v as cast_for_cache casts them."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 6, 20, generator=gen).to(device, dtype)
    k = _store_values(torch.randn(9, 3, 20, generator=gen) * 200).to(device, dtype)  # some past fp8's range
    v = _store_values(torch.randn(9, 3, 20, generator=gen)).to(device, dtype)
    slots = torch.randperm(30, generator=gen)[:9].int().to(device)
    positions = torch.zeros(9, dtype=torch.int32, device=device)
    cos_sin = torch.cat((torch.ones(1, 10), torch.zeros(1, 10)), dim=1).to(device)
    k_cache = torch.zeros(30, 3, 20, dtype=FP8, device=device)
    v_cache = torch.zeros(30, 3, 20, dtype=FP8, device=device)
    rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_k[slots.long()], ref_v[slots.long()] = cast_for_cache(k, FP8), cast_for_cache(v, FP8)
    assert torch.equal(_bits(k_cache), _bits(ref_k)) and torch.equal(_bits(v_cache), _bits(ref_v))
    assert k_cache.float().abs().max() == FP8_E4M3_MAX and torch.isfinite(k_cache.float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_into_fp8_pool(device, assert_close, dtype):
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rope_inputs(7, 4, 2, 20, 50, dtype, device)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    v.copy_(_store_values(v.float().cpu()).to(device, dtype))
    ref = [x.clone() for x in (q, k, v, positions, cos_sin, k_cache, v_cache, slots)]
    rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    rope_store_kv_ref(*ref[:7], ref[7].long())
    assert_close(q, ref[0])
    assert torch.equal(_bits(v_cache), _bits(ref[6]))
    if not INTERPRETED:  # rotated keys need rounding (see INTERPRETED); a last-bit difference in
        # the rotation (fused multiply-adds) may move a key one fp8 step (2**-3 relative)
        torch.testing.assert_close(k_cache.float(), ref[5].float(), atol=2**-9, rtol=2**-3)


def _fp8_batch(seqs, dtype, device, heads=(4, 2, 32)):
    batch = make_batch(seqs, *heads, dtype, device, seed=5)
    batch.k_cache = cast_for_cache(batch.k_cache * 3, FP8)  # spread over fp8's exponents
    batch.v_cache = cast_for_cache(batch.v_cache, FP8)
    return batch


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_fp8_pool(device, assert_close, dtype):
    kv_lens = [1, 7, 13, 64, 97]
    batch = _fp8_batch([(1, n) for n in kv_lens], dtype, device)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, batch.kv_lens,
            max(kv_lens), 32**-0.5)
    out = decode_attention_triton(*args)
    assert_close(out, decode_attention_ref(*args))
    # the same values in a pool of the model's dtype (products in that dtype, not fp16) agree
    widened = (*args[:1], batch.k_cache.to(dtype), batch.v_cache.to(dtype), *args[3:])
    assert_close(decode_attention_triton(*widened), out)


@pytest.mark.parametrize("head_dim,kv_heads,sms", [(64, 8, 132), (128, 8, 132), (64, 2, 78), (80, 3, 114)])
def test_fp8_pool_takes_one_warp_a_program_once_programs_are_many(head_dim, kv_heads, sms):
    """From 6 programs an SM (llama shapes on 132 SMs: 99 sequences) the fp8 pool's tile; below it, and for
    fp32 queries, the 16-bit pool's (head_dim 128: its tile for many programs); warm-up's decode step
    (executor/warmup.py) is the first size that takes it."""
    bf16 = torch.bfloat16
    (dense,) = dense_tile_batch_sizes(kv_heads, sms, FP8)
    assert pick_tile(bf16, head_dim, dense * kv_heads, sms, FP8) == TILE_FP8_POOL_DENSE
    assert pick_tile(bf16, head_dim, 256 * kv_heads, sms, FP8) == TILE_FP8_POOL_DENSE
    for programs in (1, (dense - 1) * kv_heads):  # (head_dim 128's tile for few programs is the 16-bit pool's)
        expected = TILE_HEAD_DIM_128 if head_dim > 64 else pick_tile(bf16, head_dim, programs, sms)
        assert pick_tile(bf16, head_dim, programs, sms, FP8) == expected
    assert pick_tile(torch.float32, head_dim, 256 * 8, 132, FP8) == pick_tile(torch.float32, head_dim, 256 * 8, 132)
    assert dense_tile_batch_sizes(8, 132, FP8) == [99]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_reads_fp8_pool_at_its_dense_tile(device, assert_close, dtype, head_dim):
    """The fp8 pool's tile (one warp; one split, as where programs are many) against the reference."""
    kv_lens = [1, 70, 13, 200, 97]
    batch = _fp8_batch([(1, n) for n in kv_lens], dtype, device, heads=(8, 2, head_dim))
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, batch.kv_lens,
            max(kv_lens), head_dim**-0.5)
    block_n, warps, stages = TILE_FP8_POOL_DENSE
    assert_close(_decode_attention_launch(*args, 1, block_n, warps, stages), decode_attention_ref(*args))


@pytest.mark.interpreter_bf16
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_cpu_path_reads_fp8_pool(assert_close, dtype):
    batch = _fp8_batch([(1, n) for n in [1, 7, 13, 64]], dtype, "cpu")
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, batch.kv_lens, 64,
            32**-0.5)
    assert_close(decode_attention_cpu(*args), decode_attention_ref(*args), scale=1 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_reads_fp8_pool(device, assert_close, dtype):
    seqs = [(1, 1), (7, 12), (19, 19), (3, 40)]
    batch = _fp8_batch(seqs, dtype, device)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, batch.q_start,
            batch.q_lens, batch.kv_lens, 19, 32**-0.5)
    assert_close(prefill_attention_triton(*args), prefill_attention_ref(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unified_attention_reads_fp8_pool(device, assert_close, dtype):
    seqs = [(1, 5), (1, 97), (7, 12), (19, 19), (3, 40)]
    batch = _fp8_batch(seqs, dtype, device)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, q_bounds(batch),
            batch.kv_lens, 32**-0.5)
    assert_close(unified_attention_triton(*args), unified_attention_ref(*args))
