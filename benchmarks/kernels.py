"""Benchmarks of batchgen's Triton kernels against their torch references, on decode and prefill
shapes of llama-3.2-1b and llama-3.1-8b. Attention is also timed against
torch.nn.functional.scaled_dot_product_attention on the equivalent padded dense inputs (K/V already
gathered: SDPA's time excludes the gather through req_to_token).

Times are medians of triton.testing.do_bench (L2 flushed before every run). Bandwidth is the
fewest bytes the op must move (each input read once, each output written once) over the time,
and a fraction of the device copy bandwidth measured here (a 2 GiB device-to-device copy, bytes
read + written). Prefill attention also reports TFLOP/s (4 * D flops per visible (query, key) pair).

    PYTHONPATH=. python benchmarks/kernels.py [--sweep] [--budget-s S]
        [--only decode,prefill,elementwise,unified,rope_store,gemm]

One JSON line per measurement; a table last. --sweep also times block-size variants of the
attention kernels, each checked against the default first (the tuning behind the defaults; see
benchmarks/KERNELS.md). "unified" times unified attention (one launch for a mixed step) against the
decode + prefill launches of the same step; "rope_store" the fused rope + KV store against its torch
reference. The issue #11 run: --only unified,rope_store --sweep --budget-s 100 (about 2 minutes).
"gemm" times the model's products (cuBLAS through F.linear, cuBLASLt, and at one row the skinny kernel
with and without its SiLU-and-mul, with plain loads and, on Hopper, through TMA; at 2 to 64 rows on Hopper
the tile kernel: o and down as split-K parts, gate/up also with its SiLU-and-mul against cuBLAS + the
SiLU-and-mul kernel) at decode batch sizes as a
CUDA graph replays them: 16 distinct weights a replay (as 16 layers: nothing stays in L2), no host
launch cost (do_bench of one small product measures Python's launch, not the GPU).
"""
import argparse
import json
import random
import signal
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from batchgen.kernels.decode_attention import (
    _decode_attention_launch,
    decode_attention_ref,
    decode_attention_triton,
    pick_num_splits,
)
from batchgen.kernels.device import num_sms
from batchgen.kernels.prefill_attention import (
    _prefill_attention_launch,
    prefill_attention_ref,
    prefill_attention_triton,
)
from batchgen.kernels.rmsnorm import add_rmsnorm_ref, add_rmsnorm_triton, rmsnorm_ref, rmsnorm_triton
from batchgen.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton
from batchgen.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from batchgen.kernels.skinny_gemm import default_tile, skinny_gemm_triton, tma_ok, tma_supported, tma_tile
from batchgen.kernels.tile_gemm import MAX_ROWS as TILE_MAX_ROWS
from batchgen.kernels.tile_gemm import pick_tile, tile_gemm_supported, tile_gemm_triton
from batchgen.kernels.unified_attention import _unified_attention_launch, unified_attention_triton

MODELS = {
    "llama-3.2-1b": dict(hidden=2048, inter=8192, q_heads=32, kv_heads=8, head_dim=64, vocab=128256),
    "llama-3.1-8b": dict(hidden=4096, inter=14336, q_heads=32, kv_heads=8, head_dim=128, vocab=128256),
}
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16 element
DEVICE = "cuda"

RECORDS = []
START = time.time()


def emit(**record):
    RECORDS.append(record)
    print(json.dumps(record), flush=True)


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, read + write counted."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    emit(kind="copy", nbytes=nbytes, ms=ms, gbps=nbytes / ms / 1e6)
    del src, dst
    return nbytes / ms * 1e3


def measure(kind, model, shape, nbytes, impls, copy_bw, flops=None, variant=None):
    """impls: {name: fn}; emits one record per impl."""
    for impl, fn in impls.items():
        try:
            ms = bench_ms(fn)
        except Exception as e:  # a reference that does not fit, an unsupported SDPA backend
            emit(kind=kind, model=model, shape=shape, impl=impl, error=repr(e)[:200])
            continue
        rec = dict(kind=kind, model=model, shape=shape, impl=impl, ms=round(ms, 5),
                   gbps=round(nbytes / ms / 1e6, 1), bw_frac=round(nbytes / ms * 1e3 / copy_bw, 3))
        if flops is not None:
            rec["tflops"] = round(flops / ms / 1e9, 1)
        if variant is not None:
            rec["variant"] = variant
        emit(**rec)


def check_variant(kind, model, shape, variant, fn, expected) -> bool:
    """A swept variant must match the default launcher (itself checked against the reference)."""
    try:
        torch.testing.assert_close(fn(), expected, atol=1.6e-2, rtol=1.6e-2)
        return True
    except Exception as e:  # a failed compile (resources) or a wrong result: record, go on
        emit(kind=kind, model=model, shape=shape, variant=variant, error=repr(e)[:300])
        return False


# ---------------------------------------------------------------- elementwise ops

ELEMENTWISE_TOKENS = [(256, "decode"), (8192, "prefill")]  # a decode batch, a prefill step


def rope_store_inputs(cfg, tokens):
    """The arguments of rope + KV store, in rope_store_kv's order: q, k, v [T, H, D] as views into one
    qkv output, positions and a cos/sin table over 8192 positions, a pool of 2^17 slots, T slots in it."""
    hq, hk, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=DTYPE, device=DEVICE)
    q, k, v = (x.view(tokens, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    angles = torch.outer(torch.arange(8192, device=DEVICE).float(), torch.rand(d // 2, device=DEVICE))
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    k_cache = torch.empty(1 << 17, hk, d, dtype=DTYPE, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0], device=DEVICE)[:tokens]
    return q, k, v, positions, cache, k_cache, v_cache, slots


def bench_elementwise(model, cfg, copy_bw):
    hidden, inter = cfg["hidden"], cfg["inter"]
    for tokens, phase in ELEMENTWISE_TOKENS:
        shape = f"{phase} T={tokens}"
        x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE)
        res = torch.randn_like(x)
        w = torch.rand(hidden, dtype=DTYPE, device=DEVICE)
        measure("rmsnorm", model, shape, 2 * x.numel() * ELEM, {
            "triton": lambda: rmsnorm_triton(x, w, 1e-5), "torch": lambda: rmsnorm_ref(x, w, 1e-5)}, copy_bw)
        measure("add_rmsnorm", model, shape, 4 * x.numel() * ELEM, {
            "triton": lambda: add_rmsnorm_triton(x, res, w, 1e-5),
            "torch": lambda: add_rmsnorm_ref(x, res, w, 1e-5)}, copy_bw)

        gu = torch.randn(tokens, 2 * inter, dtype=DTYPE, device=DEVICE)
        measure("silu_and_mul", model, shape, 3 * tokens * inter * ELEM, {
            "triton": lambda: silu_and_mul_triton(gu), "torch": lambda: silu_and_mul_ref(gu)}, copy_bw)


# ---------------------------------------------------------------- attention inputs


def token_table(kv_lens):
    """req_to_token over a pool of exactly sum(kv_lens) slots, randomly permuted (a long-running
    pool hands out scattered slots)."""
    num_slots = sum(kv_lens)
    perm = torch.randperm(num_slots, device=DEVICE).int()
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(kv_lens):
        table[i, :n] = perm[used : used + n]
        used += n
    return num_slots, table


def attention_inputs(cfg, seqs):
    """One step's attention inputs for seqs [(q_len, kv_len)]: q [T, Hq, D], a K/V pool of random
    contents behind token_table, and int32 per-sequence rows, q_start [B + 1] (the last: T), q_lens
    and kv_lens."""
    hq, hk, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    q_lens = [q for q, _ in seqs]
    kv_lens = [kv for _, kv in seqs]
    num_slots, table = token_table(kv_lens)
    k_cache = torch.randn(num_slots, hk, d, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), hq, d, dtype=DTYPE, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    q_start = torch.tensor([0] + q_lens, **i32).cumsum(0).int()
    return (q, k_cache, v_cache, table, torch.arange(len(seqs), **i32), q_start,
            torch.tensor(q_lens, **i32), torch.tensor(kv_lens, **i32))


def attention_cost(cfg, seqs) -> tuple[int, int]:
    """flops (4 * D per visible (query, key) pair: each query sees its sequence's cached prefix and,
    causally, its own chunk) and the fewest bytes (q read and the output written, K/V read once)."""
    hq, hk, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    pairs = sum(ql * (kv - ql) + ql * (ql + 1) // 2 for ql, kv in seqs)
    tokens, kv_tokens = sum(ql for ql, _ in seqs), sum(kv for _, kv in seqs)
    return 4 * d * hq * pairs, (2 * tokens * hq * d + 2 * kv_tokens * hk * d) * ELEM


def dense_kv(k_cache, v_cache, table, kv_len):
    """[B, Hk, L, D] copies of the K/V of equal-length sequences, for SDPA."""
    idx = table[:, :kv_len].long()
    return k_cache[idx].transpose(1, 2).contiguous(), v_cache[idx].transpose(1, 2).contiguous()


# ---------------------------------------------------------------- decode attention

DECODE_SHAPES = [(1, 4096), (32, 2048), (128, 1024), (256, 4096)]  # (batch, context)
# (split programs per SM, BLOCK_N, num_warps, num_stages). The launcher's defaults: (2, 128, 4, 2)
# for head_dim 64, (2, 64, 4, 3) for 128.
DECODE_VARIANTS = [(2, 128, 4, 2), (2, 64, 4, 3), (2, 64, 4, 2), (1, 64, 4, 2), (4, 64, 4, 2),
                   (8, 64, 4, 2), (2, 32, 4, 2), (2, 128, 4, 3), (2, 128, 8, 2), (2, 256, 4, 2),
                   (2, 64, 4, 4), (2, 64, 2, 2), (4, 32, 2, 3), (4, 128, 4, 2)]


def bench_decode(model, cfg, copy_bw, sweep, budget_s):
    scale = cfg["head_dim"] ** -0.5
    for batch, kv_len in DECODE_SHAPES:
        shape = f"decode B={batch} L={kv_len}"
        seqs = [(1, kv_len)] * batch
        q, k_cache, v_cache, table, rows, _, _, lens = attention_inputs(cfg, seqs)
        args = (q, k_cache, v_cache, table, rows, lens, kv_len, scale)
        nbytes = attention_cost(cfg, seqs)[1] + batch * kv_len * 4  # (+ the token table's int32 slots)
        torch.testing.assert_close(decode_attention_triton(*args), decode_attention_ref(*args),
                                   atol=1.6e-2, rtol=1.6e-2)
        impls = {"triton": lambda: decode_attention_triton(*args)}
        if batch * kv_len <= 128 * 1024:  # the reference materialises fp32 copies of K and V
            impls["torch"] = lambda: decode_attention_ref(*args)
        k_dense, v_dense = dense_kv(k_cache, v_cache, table, kv_len)
        q4 = q[:, :, None, :]  # [B, Hq, 1, D]
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale,
                                                               enable_gqa=True)
        measure("decode_attention", model, shape, nbytes, impls, copy_bw)
        if sweep:
            expected = decode_attention_triton(*args)
            for per_sm, block_n, warps, stages in DECODE_VARIANTS:
                if time.time() - START > budget_s:
                    break
                splits = pick_num_splits(batch, cfg["kv_heads"], kv_len, block_n, num_sms(q.device) * per_sm // 2)
                variant = f"per_sm={per_sm} C={splits} N={block_n} w={warps} s={stages}"
                fn = lambda: _decode_attention_launch(*args, splits, block_n, warps, stages)  # noqa: E731
                if check_variant("decode_attention", model, shape, variant, fn, expected):
                    measure("decode_attention", model, shape, nbytes, {"triton": fn}, copy_bw, variant=variant)
        del k_cache, v_cache, k_dense, v_dense


# ---------------------------------------------------------------- prefill attention


def prefill_shapes():
    rng = random.Random(0)
    mixed = []
    for _ in range(48):  # splitfuse-like: short chunks, some on long cached prefixes
        q_len = rng.randint(1, 256)
        mixed.append((q_len, q_len + rng.choice([0, rng.randint(1, 3000)])))
    return [
        ("prompt 1x4096", [(4096, 4096)]),
        ("prompts 8x512", [(512, 512)] * 8),
        ("extend 4x512 on 1536 cached", [(512, 2048)] * 4),
        ("mixed 48 chunks", mixed),
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages); the launcher's default for 16-bit inputs: (64, 64, 4, 3).
PREFILL_VARIANTS = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 4, 3),
                    (64, 64, 8, 3), (32, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                    (128, 128, 8, 2), (128, 32, 4, 3)]


def bench_prefill(model, cfg, copy_bw, sweep, budget_s):
    hq, d = cfg["q_heads"], cfg["head_dim"]
    scale = d**-0.5
    for shape, seqs in prefill_shapes():
        q, k_cache, v_cache, table, rows, q_start, q_lens, kv_lens = attention_inputs(cfg, seqs)
        args = (q, k_cache, v_cache, table, rows, q_start[:-1], q_lens, kv_lens, max(q for q, _ in seqs), scale)
        flops, nbytes = attention_cost(cfg, seqs)
        torch.testing.assert_close(prefill_attention_triton(*args), prefill_attention_ref(*args),
                                   atol=1.6e-2, rtol=1.6e-2)
        impls = {"triton": lambda: prefill_attention_triton(*args),
                 "torch": lambda: prefill_attention_ref(*args)}
        if len(set(seqs)) == 1:  # equal sequences: one dense SDPA call
            (q_len, kv_len), batch = seqs[0], len(seqs)
            k_dense, v_dense = dense_kv(k_cache, v_cache, table, kv_len)
            q4 = q.view(batch, q_len, hq, d).transpose(1, 2)  # [B, Hq, q_len, D]
            if q_len == kv_len:
                impls["sdpa"] = lambda: F.scaled_dot_product_attention(
                    q4, k_dense, v_dense, is_causal=True, scale=scale, enable_gqa=True)
            else:  # bottom-right causal mask for a chunk on a cached prefix
                pos = torch.arange(kv_len, device=DEVICE)
                mask = pos[-q_len:, None] >= pos[None, :]
                impls["sdpa"] = lambda: F.scaled_dot_product_attention(
                    q4, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=True)
        measure("prefill_attention", model, shape, nbytes, impls, copy_bw, flops=flops)
        if sweep:
            expected = prefill_attention_triton(*args)
            for block_m, block_n, warps, stages in PREFILL_VARIANTS:
                if time.time() - START > budget_s:
                    break
                variant = f"M={block_m} N={block_n} w={warps} s={stages}"
                fn = lambda: _prefill_attention_launch(*args, block_m, block_n, warps, stages)  # noqa: E731
                if check_variant("prefill_attention", model, shape, variant, fn, expected):
                    measure("prefill_attention", model, shape, nbytes, {"triton": fn}, copy_bw,
                            flops=flops, variant=variant)


# ---------------------------------------------------------------- unified attention


def unified_shapes():
    """(name, [(q_len, kv_len)], decodes first, padded (T, B) as a step graph would run it)."""
    rng = random.Random(1)
    decodes = [(1, rng.randint(250, 350)) for _ in range(200)]
    chunks = [(256, 256 + prefix) for prefix in (0, 256, 512, 1024)]
    return [
        ("decode B=256 L=512", [(1, 512)] * 256, None),
        ("decode B=256 L=2048", [(1, 2048)] * 256, None),
        ("decode B=256 L=512..2048", [(1, rng.randint(512, 2048)) for _ in range(256)], None),
        ("mixed 200 dec L~300 + 4x256", decodes + chunks, (1280, 256)),
        ("prefill 1x4096", [(4096, 4096)], (4096, 256)),
        ("W-offline prefill step", _packed_prompts(rng, 100, 1024), (8192, 256)),
        ("W-short prefill step", _packed_prompts(rng, 32, 256), (8192, 256)),
    ]


def _packed_prompts(rng, shortest, longest, budget=8192):
    """Whole prompts of U[shortest, longest] tokens from an empty cache, the last one cut to fill a
    step's token budget: a prefill step of W-offline or W-short."""
    seqs = []
    while budget > 0:
        n = min(rng.randint(shortest, longest), budget)
        seqs.append((n, n))
        budget -= n
    return seqs


# (BLOCK_M, SMALL_M, BLOCK_N, num_warps, num_stages), most promising first; the launcher's default
# for 16-bit inputs: (64, 16, 64, 4, 3).
UNIFIED_VARIANTS = [(64, 16, 64, 4, 3), (64, 16, 64, 8, 3), (128, 16, 64, 8, 3), (64, 16, 128, 4, 2),
                    (64, 32, 64, 4, 3), (64, 16, 32, 4, 3), (32, 16, 64, 4, 3), (64, 16, 64, 4, 2),
                    (128, 16, 64, 8, 2), (16, 16, 64, 4, 3), (128, 16, 64, 4, 3), (128, 16, 32, 4, 3),
                    (64, 16, 32, 4, 4), (128, 16, 128, 8, 2), (256, 16, 64, 8, 2), (64, 16, 64, 4, 4)]


def unified_case(cfg, seqs, padded):
    """Inputs of one step: the unified launch's arguments (and the padded step's), the split
    launches as a function, the bytes and flops of the step."""
    hq, d = cfg["q_heads"], cfg["head_dim"]
    scale = d**-0.5
    i32 = dict(dtype=torch.int32, device=DEVICE)
    q_lens = [q for q, _ in seqs]
    kv_lens = [kv for _, kv in seqs]
    nd = next((i for i, q_len in enumerate(q_lens) if q_len > 1), len(seqs))  # leading decodes
    q, k_cache, v_cache, table, rows, q_start, q_lens_t, lens = attention_inputs(cfg, seqs)
    total = sum(q_lens)
    prefill_start = q_start[nd:-1] - nd
    prefill_q_lens = q_lens_t[nd:]

    def split():
        """The eager layer's launches: decode attention, then prefill attention."""
        outs = []
        if nd:
            outs.append(decode_attention_triton(q[:nd], k_cache, v_cache, table, rows[:nd], lens[:nd],
                                                max(kv_lens[:nd]), scale))
        if nd < len(seqs):
            outs.append(prefill_attention_triton(
                q[nd:], k_cache, v_cache, table, rows[nd:], prefill_start, prefill_q_lens, lens[nd:],
                max(q_lens[nd:]), scale))
        return outs

    case = dict(args=(q, k_cache, v_cache, table, rows, q_start, lens, scale), split=split, padded_args=None)
    if padded is not None:  # as a step graph runs it: T and B padded, padding sequences empty
        pad_t, pad_b = padded
        q_pad = torch.cat((q, torch.zeros(pad_t - total, hq, d, dtype=DTYPE, device=DEVICE)))
        pad_seqs = torch.zeros(pad_b - len(seqs), **i32)
        case["padded_args"] = (q_pad, k_cache, v_cache, table, torch.cat((rows, pad_seqs)),
                               torch.cat((q_start, pad_seqs + total)), torch.cat((lens, pad_seqs)), scale)
    case["flops"], case["nbytes"] = attention_cost(cfg, seqs)
    case["total"] = total
    return case


def bench_unified(copy_bw, sweep, budget_s):
    """Every model and shape with the default tiles (unified, split, padded), then the sweep one
    variant at a time over all of them (one compile per variant and model; the budget cuts whole
    variants, for both models alike)."""
    cases = {(model, shape): unified_case(cfg, seqs, padded)
             for model, cfg in MODELS.items() for shape, seqs, padded in unified_shapes()}
    expected = {}
    for (model, shape), case in cases.items():
        expected[model, shape] = torch.cat(case["split"]())
        args, padded_args = case["args"], case["padded_args"]
        torch.testing.assert_close(unified_attention_triton(*args), expected[model, shape], atol=1.6e-2, rtol=1.6e-2)
        impls = {"unified": lambda: unified_attention_triton(*args), "split": case["split"]}
        if padded_args is not None:
            torch.testing.assert_close(unified_attention_triton(*padded_args)[: case["total"]],
                                       expected[model, shape], atol=1.6e-2, rtol=1.6e-2)
            impls["unified_padded"] = lambda: unified_attention_triton(*padded_args)
        measure("unified_attention", model, shape, case["nbytes"], impls, copy_bw, flops=case["flops"])
    if not sweep:
        return
    for config in UNIFIED_VARIANTS[1:]:
        if time.time() - START > budget_s:
            break
        variant = "M={} small={} N={} w={} s={}".format(*config)
        for (model, shape), case in cases.items():
            fn = lambda: _unified_attention_launch(*case["args"], *config)  # noqa: E731
            if check_variant("unified_attention", model, shape, variant, fn, expected[model, shape]):
                measure("unified_attention", model, shape, case["nbytes"], {"unified": fn}, copy_bw,
                        flops=case["flops"], variant=variant)


def bench_rope_store(model, cfg, copy_bw):
    hq, hk, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    for tokens, phase in ELEMENTWISE_TOKENS:
        args = rope_store_inputs(cfg, tokens)
        # q read + written, k and v read, k and v written to the cache, cos/sin read
        nbytes = (2 * hq + 4 * hk) * tokens * d * ELEM + tokens * d * 4
        measure("rope_store_kv", model, f"{phase} T={tokens}", nbytes, {
            "fused": lambda: rope_store_kv_triton(*args),
            "torch": lambda: rope_store_kv_ref(*args)}, copy_bw)


# ---------------------------------------------------------------- table


def fastest_variants(records, kinds) -> dict:
    """(kind, model, shape) -> the fastest swept block-size variant timed for it, for the given kinds."""
    best = {}
    for r in records:
        if r.get("kind") in kinds and "variant" in r and "ms" in r:
            key = (r["kind"], r["model"], r["shape"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    return best


def print_table():
    rows = {}
    for r in RECORDS:
        if "model" not in r or "variant" in r or "ms" not in r:
            continue
        key = (r["kind"], r["model"], r["shape"])
        rows.setdefault(key, {})[r["impl"]] = r
    if not any("triton" in impls for impls in rows.values()):
        return
    print(f"\n{'op':<18} {'model':<13} {'shape':<30} {'triton us':>10} {'torch us':>10} "
          f"{'sdpa us':>9} {'x torch':>8} {'bw frac':>8} {'TFLOP/s':>8}")
    for (kind, model, shape), impls in rows.items():
        t = impls.get("triton")
        if t is None:
            continue

        def us(name):
            return f"{impls[name]['ms'] * 1e3:.1f}" if name in impls else "-"

        speedup = f"{impls['torch']['ms'] / t['ms']:.1f}" if "torch" in impls else "-"
        print(f"{kind:<18} {model:<13} {shape:<30} {us('triton'):>10} {us('torch'):>10} {us('sdpa'):>9} "
              f"{speedup:>8} {t['bw_frac']:>8.2f} {t.get('tflops', '-'):>8}")
    best = fastest_variants(RECORDS, ("decode_attention", "prefill_attention"))  # unified's: the issue #11 table
    if best:
        print("\nfastest swept variant per shape:")
        for (kind, model, shape), r in best.items():
            default = rows.get((kind, model, shape), {}).get("triton")
            ref = f"{default['ms'] * 1e3:.1f}" if default else "-"
            print(f"{kind:<18} {model:<13} {shape:<30} {r['ms'] * 1e3:>8.1f} us (default {ref} us)  {r['variant']}")


def print_issue11_table():
    """unified attention against the split launches; fused rope + store against its torch reference."""
    kinds = ("unified_attention", "rope_store_kv")
    rows, best = {}, fastest_variants(RECORDS, kinds)
    for r in RECORDS:
        if r.get("kind") in kinds and "ms" in r and "variant" not in r:
            rows.setdefault((r["kind"], r["model"], r["shape"]), {})[r["impl"]] = r
    if not rows:
        return
    print(f"\n{'op':<18} {'model':<13} {'shape':<28} {'new us':>8} {'old us':>8} {'old/new':>8} "
          f"{'padded us':>10} {'bw frac':>8} {'TFLOP/s':>8}  best swept variant")
    for (kind, model, shape), impls in rows.items():
        new = impls.get("unified") or impls.get("fused")
        old = impls.get("split") or impls.get("torch")
        if new is None or old is None:
            continue
        padded = f"{impls['unified_padded']['ms'] * 1e3:.1f}" if "unified_padded" in impls else "-"
        b = best.get((kind, model, shape))
        swept = f"{b['ms'] * 1e3:.1f} us {b['variant']}" if b and b["ms"] < new["ms"] else "-"
        print(f"{kind:<18} {model:<13} {shape:<28} {new['ms'] * 1e3:>8.1f} {old['ms'] * 1e3:>8.1f} "
              f"{old['ms'] / new['ms']:>8.2f} {padded:>10} {new['bw_frac']:>8.2f} {new.get('tflops', '-'):>8}  {swept}")


# ---------------------------------------------------------------- products (cuBLAS)

GEMM_BATCHES = [1, 2, 16, 64, 128, 144, 192, 208, 224, 256]
PEAK_BF16_FLOPS = 790e12  # an H200's bf16 product on random data (as measured on the lent H200s)


def bench_gemm(model, cfg, copy_bw):
    """y = x W^T for each weight of a layer (and the LM head) at each decode batch size; the floor is
    the larger of the weight read at copy bandwidth and the products at PEAK_BF16_FLOPS."""
    h, inter, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    weights = {"qkv": ((cfg["q_heads"] + 2 * cfg["kv_heads"]) * d, h), "o": (h, cfg["q_heads"] * d),
               "gate_up": (2 * inter, h), "down": (h, inter), "lm_head": (cfg["vocab"], h)}
    try:
        for name, (n, k) in weights.items():
            copies = 2 if name == "lm_head" else 16  # (the LM head alone is past L2)
            ws = [torch.randn(n, k, dtype=DTYPE, device=DEVICE) * 0.02 for _ in range(copies)]

            def replay_us(fn):  # one product's share of a graph replay of all the copies
                return 1e3 * do_bench_cudagraph(fn, return_mode="median") / copies
            for m in GEMM_BATCHES:
                x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
                floor_us = max(n * k * ELEM / copy_bw, 2 * m * n * k / PEAK_BF16_FLOPS) * 1e6
                impls = {library: lambda: [F.linear(x, w) for w in ws] for library in ("cublas", "cublaslt")}
                if m == 1:  # what the engine may run for one row (layers/packed_linear.py, skinny_gemm.uses_tma)
                    impls["skinny"] = lambda: [skinny_gemm_triton(x, w, tile=default_tile(n, k)) for w in ws]
                    if tma_supported(x.device) and tma_ok(ws[0]):
                        impls["skinny_tma"] = lambda: [skinny_gemm_triton(x, w, tile=tma_tile(n, k)) for w in ws]
                elif m <= TILE_MAX_ROWS and tile_gemm_supported(x.device) and pick_tile(m, n, k, False) is not None:
                    # (kernels/tile_gemm.py; N <= K products as the engine runs them: split-K parts)
                    impls["tile"] = lambda: [tile_gemm_triton(x, w, parts_ok=n <= k) for w in ws]
                    if name == "gate_up":
                        impls["cublas+silu"] = lambda: [silu_and_mul_triton(F.linear(x, w)) for w in ws]
                        impls["tile_silu"] = lambda: [tile_gemm_triton(x, w, silu_mul_out=True) for w in ws]
                for impl, fn in impls.items():
                    torch.backends.cuda.preferred_blas_library("cublaslt" if impl == "cublaslt" else "cublas")
                    us = replay_us(fn)
                    emit(kind="gemm", model=model, shape=f"{name} M={m}", impl=impl, us=round(us, 2),
                         floor_us=round(floor_us, 2), gbps=round(n * k * ELEM / us / 1e3, 1))
            if name == "down":  # one row: SiLU-and-mul + cuBLAS, against the skinny product that applies it
                torch.backends.cuda.preferred_blas_library("cublas")
                gate_up = torch.randn(1, 2 * k, dtype=DTYPE, device=DEVICE)
                plain, tma = default_tile(n, k), tma_tile(n, k)
                impls = {"silu+cublas": lambda: [F.linear(silu_and_mul_triton(gate_up), w) for w in ws],
                         "skinny_silu": lambda: [skinny_gemm_triton(gate_up, w, silu_mul=True, tile=plain) for w in ws]}
                if tma_supported(gate_up.device) and tma_ok(ws[0]):
                    impls["skinny_tma_silu"] = lambda: [skinny_gemm_triton(gate_up, w, silu_mul=True, tile=tma)
                                                        for w in ws]
                for impl, fn in impls.items():
                    emit(kind="gemm", model=model, shape="down+silu M=1", impl=impl, us=round(replay_us(fn), 2))
            del ws
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time attention block-size variants")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop sweeping after this many seconds")
    parser.add_argument("--only", default="",
                        help="comma-separated subset: elementwise,decode,prefill,unified,rope_store,gemm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    parts = set(args.only.split(",")) if args.only else {"elementwise", "decode", "prefill", "unified", "rope_store"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))  # still print the table
    props = torch.cuda.get_device_properties(0)
    emit(kind="device", name=props.name, sms=props.multi_processor_count, torch=torch.__version__,
         triton=triton.__version__)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    try:
        for model, cfg in MODELS.items():
            if "decode" in parts:
                bench_decode(model, cfg, copy_bw, args.sweep, args.budget_s)
            if "prefill" in parts:
                bench_prefill(model, cfg, copy_bw, args.sweep, args.budget_s)
        if "unified" in parts:
            bench_unified(copy_bw, args.sweep, args.budget_s)
        for model, cfg in MODELS.items():
            if "elementwise" in parts:
                bench_elementwise(model, cfg, copy_bw)
            if "rope_store" in parts:
                bench_rope_store(model, cfg, copy_bw)
            if "gemm" in parts:
                bench_gemm(model, cfg, copy_bw)
    finally:
        print_table()
        print_issue11_table()


if __name__ == "__main__":
    main()
