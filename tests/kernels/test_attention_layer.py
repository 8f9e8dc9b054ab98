"""The attention layer's two ways through a mixed step: decode + prefill launches, and the unified
launch the step graphs use (padded sequences and tokens), from the same q/k/v before rope; and its
two ways through a lone sequence's decode on a GPU: one launch, or rope_store_kv and decode attention."""
from dataclasses import replace

import pytest
import torch

from batchgen.kernels.kv_dtype import cast_for_cache
from batchgen.layers import attention
from batchgen.layers.attention import Attention
from batchgen.layers.forward_batch import ForwardBatch
from tests.kernels.attention_batch import make_batch, q_bounds

HQ, HK, D = 4, 2, 16
DECODES = [(1, 9), (1, 30), (1, 1)]
CHUNKS = [(7, 12), (19, 19), (2, 40)]


def _cos_sin_cache(max_pos, device, head_dim=D):
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(head_dim // 2) * 0.3)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def _step(device, dtype):
    """The batch's token table and pool, the new tokens' positions and slots, and q/k/v."""
    seqs = DECODES + CHUNKS
    b = make_batch(seqs, HQ, HK, D, dtype, device, seed=3)
    positions = torch.cat([torch.arange(kv - q, kv) for q, kv in seqs]).to(device)
    rows = torch.cat([torch.full((q,), row) for (q, _), row in zip(seqs, b.req_rows.tolist())]).to(device)
    out_slots = b.req_to_token[rows, positions].long()
    qkv = torch.randn(len(positions), (HQ + 2 * HK) * D, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    return b, positions, rows, out_slots, qkv


def _split_batch(b, positions, rows, out_slots):
    nd, i32 = len(DECODES), torch.int32
    return ForwardBatch(
        input_ids=torch.zeros_like(positions), positions=positions, out_slots=out_slots, token_rows=rows.int(),
        req_to_token=b.req_to_token, num_decode=nd,
        decode_rows=b.req_rows[:nd], decode_kv_lens=b.kv_lens[:nd], decode_max_kv_len=int(b.kv_lens[:nd].max()),
        prefill_rows=b.req_rows[nd:], prefill_q_start=(b.q_start[nd:] - nd).to(i32), prefill_q_lens=b.q_lens[nd:],
        prefill_kv_lens=b.kv_lens[nd:], prefill_max_q_len=int(b.q_lens[nd:].max()),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=positions.device),
    )


def _unified_batch(split, b, pad_seqs, pad_tokens, dummy_slot):
    """The same step as the graphs see it: padding sequences (no tokens) and padding tokens
    (position 0, the dummy slot) after the real ones."""
    dev, i32 = b.q.device, torch.int32
    zeros = torch.zeros(pad_seqs, dtype=i32, device=dev)
    pad = torch.zeros(pad_tokens, dtype=torch.int64, device=dev)
    q_start = q_bounds(b)
    return replace(
        split,
        positions=torch.cat((split.positions, pad)),
        out_slots=torch.cat((split.out_slots, pad + dummy_slot)),
        unified=True,
        q_start=torch.cat((q_start, q_start[-1:].expand(pad_seqs))),
        seq_rows=torch.cat((b.req_rows, zeros)),
        kv_lens=torch.cat((b.kv_lens, zeros + 3)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unified_step_equals_split_step(device, assert_close, dtype):
    b, positions, rows, out_slots, qkv = _step(device, dtype)
    cos_sin = _cos_sin_cache(64, device)
    total, pad_tokens = len(positions), 5
    dummy_slot = b.k_cache.shape[0]  # one slot past the pool's used ones, as the runner reserves

    def run(batch, num_tokens):
        layer = Attention(HQ, HK, D, D**-0.5)
        pool = torch.cat((b.k_cache, b.k_cache[:1])), torch.cat((b.v_cache, b.v_cache[:1]))
        layer.k_cache, layer.v_cache = pool
        padded = torch.cat((qkv, torch.randn(num_tokens - total, qkv.shape[1]).to(qkv)))
        q, k, v = padded.split([HQ * D, HK * D, HK * D], dim=-1)
        view = lambda x, h: x.view(num_tokens, h, D)  # noqa: E731
        out = layer(view(q, HQ), view(k, HK), view(v, HK), batch.positions, cos_sin, batch)
        return out[:total], layer.k_cache[:dummy_slot], layer.v_cache[:dummy_slot]

    split = _split_batch(b, positions, rows, out_slots)
    expected = run(split, total)
    actual = run(_unified_batch(split, b, 4, pad_tokens, dummy_slot), total + pad_tokens)
    assert_close(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1]) and torch.equal(actual[2], expected[2])


def test_fp8_pool_with_kv_scales_keeps_keys_and_values_out_of_fp8s_range(device):
    """K and V far past fp8's +-448 (saturated, unscaled) and V far below its smallest steps: with the
    checkpoint's k_scale / v_scale the pool holds k / k_scale and v / v_scale, and the layer's output stays
    close to an fp32 pool's; without them it does not."""
    b, positions, rows, out_slots, qkv = _step(device, torch.float32)
    cos_sin = _cos_sin_cache(64, device)
    split = _split_batch(b, positions, rows, out_slots)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    big, small = 3000.0, 1e-4  # (keys that would saturate, values that would lose every digit in e4m3)
    k, v, q = k * big, v * small, q / big

    def run(pool_dtype, k_scale=1.0, v_scale=1.0):
        layer = Attention(HQ, HK, D, D**-0.5)
        # the earlier tokens' K/V, stored as the layer stores them
        layer.k_cache = cast_for_cache(b.k_cache.float() * big / k_scale, pool_dtype)
        layer.v_cache = cast_for_cache(b.v_cache.float() * small / v_scale, pool_dtype)
        layer.k_scale, layer.v_scale = k_scale, v_scale
        t = len(positions)
        out = layer(q.reshape(t, HQ, D).clone(), k.reshape(t, HK, D).clone(), v.reshape(t, HK, D).clone(),
                    split.positions, cos_sin, split)
        return out, layer

    want, _ = run(torch.float32)
    scaled, layer = run(torch.float8_e4m3fn, k_scale=big / 64, v_scale=small / 64)
    unscaled, _ = run(torch.float8_e4m3fn)
    assert layer.k_cache[out_slots].float().abs().max() < 448  # (not saturated: k / k_scale)
    new = (scaled - want).abs().max() / want.abs().max()
    old = (unscaled - want).abs().max() / want.abs().max()
    assert new < 0.1 < old, (new, old)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["views", "separate"])  # of one qkv product (Llama), or of their own (Qwen3)
def test_one_decode_row_in_one_launch_equals_three_kernels(monkeypatch, assert_close, layout):
    dev, dtype, head_dim, kv_len = "cuda", torch.bfloat16, 64, 300  # (the layer's gate: a GPU, 16 bits, D 32 or 64)
    b = make_batch([(1, kv_len)], HQ, HK, head_dim, dtype, dev, seed=5)
    positions = torch.tensor([kv_len - 1], device=dev)
    out_slots = b.req_to_token[b.req_rows.long(), positions].long()
    none = torch.zeros(0, dtype=torch.int32, device=dev)
    batch = ForwardBatch(
        input_ids=torch.zeros_like(positions), positions=positions, out_slots=out_slots, token_rows=b.req_rows,
        req_to_token=b.req_to_token, num_decode=1, decode_rows=b.req_rows, decode_kv_lens=b.kv_lens,
        decode_max_kv_len=kv_len, prefill_rows=none, prefill_q_start=none, prefill_q_lens=none, prefill_kv_lens=none,
        prefill_max_q_len=0, logits_indices=torch.zeros(1, dtype=torch.int64, device=dev),
    )
    cos_sin = _cos_sin_cache(kv_len + 8, dev, head_dim)
    qkv = torch.randn(1, (HQ + 2 * HK) * head_dim, generator=torch.Generator().manual_seed(6)).to(dev, dtype)
    one_launch_kernel, launches = attention.rope_decode_attention, []

    def counted(*args):
        launches.append(1)
        return one_launch_kernel(*args)

    monkeypatch.setattr(attention, "rope_decode_attention", counted)

    def run(one_launch):
        layer = Attention(HQ, HK, head_dim, head_dim**-0.5)
        if not one_launch:  # the layer's other way: rope_store_kv, then decode attention
            layer._takes_one_launch = lambda q, batch: False
        layer.k_cache, layer.v_cache = b.k_cache.clone(), b.v_cache.clone()
        views = [x.view(1, -1, head_dim) for x in qkv.clone().split([HQ * head_dim, HK * head_dim, HK * head_dim], -1)]
        q, k, v = views if layout == "views" else [x.clone() for x in views]
        return layer(q, k, v, positions, cos_sin, batch), layer.k_cache, layer.v_cache

    three = run(False)
    assert not launches
    one = run(True)
    assert len(launches) == 1
    assert_close(one[0], three[0], scale=2)
    written = torch.zeros(b.k_cache.shape[0], dtype=torch.bool, device=dev)
    written[out_slots] = True
    assert torch.equal(one[1][~written], three[1][~written]) and torch.equal(one[2], three[2])
    assert_close(one[1][written], three[1][written])
