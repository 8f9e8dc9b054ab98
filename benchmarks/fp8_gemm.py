"""FP8 products against bf16 at real shapes, on one GPU: per product and row count, microseconds and
TFLOP/s of bf16 (torch.mm), of the per-channel fp8 path (rounding kernel + cuBLAS's row-wise scaled
product, and the product alone) and of the 128x128 block form (Triton), each checked against the fp32
reference. Graph-replayed (100 calls a graph) so launch costs count as in the engine's graphs.

    python benchmarks/fp8_gemm.py --model llama-3.1-8b --rows 1 64 256 2048

--tune sweeps the Triton tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the per-channel and the
block form at each row count and prints the best of each (kernels/fp8_gemm.py's CHANNEL_TILES and
BLOCK_TILES come from these lines).

--tma sweeps the TMA tile kernel's fp8 form (kernels/tile_gemm.py with scales) at each row count against
cuBLAS's row-wise product, the pointer kernel's rule and its best tile, each call on one of several
copies of the weight (a graph cycles through ~150 MB of them, so no call finds its weight in the L2, as
in a step over a model's layers).

--rounding times the activations' rounding instead, at each row count: the row kernel with the row held
whole against read twice, on each product's input (down's: silu(gate) * up of the gate/up pair), and the
add + RMSNorm that rounds its output (kernels/rmsnorm.add_rmsnorm_fp8) against the norm and then the row
kernel.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchgen.kernels.fp8_gemm as fp8_gemm_module  # noqa: E402
from batchgen.kernels.e4m3 import GROUP, quantize_weight_ref  # noqa: E402
from batchgen.kernels.fp8_gemm import fp8_gemm, fp8_linear, fp8_linear_ref, quantize  # noqa: E402
from batchgen.kernels.rmsnorm import add_rmsnorm_fp8, add_rmsnorm_triton  # noqa: E402
from batchgen.kernels.tile_gemm import tile_gemm_triton  # noqa: E402

# name: {product: (N, K)}
SHAPES = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
PEAK_FP8_TFLOPS = {"H200": 1979, "H100": 1979}  # dense, SXM
CALLS = 100


def time_us(fn, calls: int = CALLS) -> float:
    """Microseconds a call of fn, from the best of 5 replays of a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 2048, 8192])
    ap.add_argument("--tune", action="store_true", help="sweep the Triton tiles (see above)")
    ap.add_argument("--rounding", action="store_true", help="time the activations' rounding (see above)")
    ap.add_argument("--tma", action="store_true", help="sweep the TMA kernel's fp8 tiles (see above)")
    args = ap.parse_args(argv)
    if args.rounding:
        return time_rounding(args.model, args.rows)
    if args.tma:
        return sweep_tma(args.model, args.rows)
    gpu = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FP8_TFLOPS.items() if k in gpu), None)
    torch.manual_seed(0)
    for name, (N, K) in SHAPES[args.model].items():
        w = torch.randn(N, K, device="cuda") * 0.02
        wb = w.bfloat16()
        wq, ws = quantize_weight_ref(w)
        bq, bs = quantize_weight_ref(w, block=True)
        del w
        for rows in args.rows:
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            q, s = quantize(x)
            gq, gs = quantize(x, group=GROUP)
            flops = 2 * rows * N * K
            line = {"gpu": gpu, "model": args.model, "product": name, "N": N, "K": K, "rows": rows}
            for label, fn in {
                "bf16": lambda: torch.mm(x, wb.t()),
                "fp8": lambda: fp8_linear(x, wq, ws),
                "fp8_mm_only": lambda: torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.view(1, -1),
                                                        out_dtype=torch.bfloat16),
                "quantize_only": lambda: quantize(x),
                "block": lambda: fp8_linear(x, bq, bs),
                "triton_mm_only": lambda: fp8_gemm(q, s, wq, ws, None, torch.bfloat16),
                "block_mm_only": lambda: fp8_gemm(gq, gs, bq, bs, None, torch.bfloat16),
            }.items():
                us = time_us(fn)
                line[f"{label}_us"] = round(us, 2)
                if label != "quantize_only":
                    line[f"{label}_tflops"] = round(flops / us / 1e6, 1)
            line["fp8_vs_bf16"] = round(line["bf16_us"] / line["fp8_us"], 3)
            line["block_vs_bf16"] = round(line["bf16_us"] / line["block_us"], 3)
            if peak:
                line["fp8_mm_pct_of_peak"] = round(100 * line["fp8_mm_only_tflops"] / peak, 1)
                line["block_mm_pct_of_peak"] = round(100 * line["block_mm_only_tflops"] / peak, 1)
            if rows <= 256:  # correctness against the fp32 reference
                ref = fp8_linear_ref(x, wq, ws).float()
                line["fp8_max_err"] = float((fp8_linear(x, wq, ws).float() - ref).abs().max())
                refb = fp8_linear_ref(x, bq, bs).float()
                line["block_max_err"] = float((fp8_linear(x, bq, bs).float() - refb).abs().max())
                line["ref_abs_max"] = float(ref.abs().max())
            if args.tune:
                for form, (qq, ss, w8, sc) in {"channel": (q, s, wq, ws), "block": (gq, gs, bq, bs)}.items():
                    timed = []
                    for tile in candidate_tiles(rows, form == "block"):
                        try:
                            timed.append((time_us(lambda: fp8_gemm(qq, ss, w8, sc, None, torch.bfloat16, tile)), tile))
                        except Exception:  # (out of shared memory)
                            continue
                    us, tile = min(timed)
                    line[f"{form}_best_tile"], line[f"{form}_best_us"] = tile, round(us, 2)
            print(json.dumps(line), flush=True)


def time_rounding(model: str, rows_list: list[int]) -> None:
    """--rounding's lines: microseconds of each way to round a product's input rows."""
    gpu = torch.cuda.get_device_name()
    shapes = SHAPES[model]
    hidden = shapes["o"][1]
    one_pass = fp8_gemm_module.ROW_IN_REGISTERS
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        pair = torch.randn(rows, 2 * shapes["down"][1], device="cuda", dtype=torch.bfloat16)
        line = {"gpu": gpu, "model": model, "rows": rows}
        inputs = {"hidden": lambda: quantize(x), "down_silu_mul": lambda: quantize(pair, silu_mul=True)}
        for label, fn in inputs.items():
            line[f"{label}_one_pass_us"] = round(time_us(fn), 2)
            fp8_gemm_module.ROW_IN_REGISTERS = 2048  # (two passes over 2,048-value blocks)
            line[f"{label}_two_pass_us"] = round(time_us(fn), 2)
            fp8_gemm_module.ROW_IN_REGISTERS = one_pass
        norm = lambda: add_rmsnorm_triton(x, residual, weight, 1e-5)  # noqa: E731
        line["norm_then_round_us"] = round(time_us(lambda: quantize(norm()[0])), 2)
        line["norm_rounds_us"] = round(time_us(lambda: add_rmsnorm_fp8(x, residual, weight, 1e-5)), 2)
        line["norm_alone_us"] = round(time_us(norm), 2)
        print(json.dumps(line), flush=True)


def time_over_copies_us(make_call, copies: int, calls: int = CALLS) -> float:
    """time_us of a graph whose calls cycle through `copies` weights (make_call(i) calls on copy i)."""
    fns = [make_call(i) for i in range(copies)]
    state = {"i": 0}

    def one():
        fns[state["i"] % copies]()
        state["i"] += 1
    return time_us(one, calls)


def tma_tiles(rows: int, n: int, k: int) -> list[tuple]:
    """tile_gemm tiles (BM, BN, BK, stages, warps, SPLIT) to try: the two smallest row tiles that hold the
    rows, 64-256 columns, K steps of 128 or 256, 3 or 5 stages within shared memory, and for N <= K K in
    1, 2 or 4 parts (summed by the norm after the product)."""
    bms = [b for b in (16, 32, 64, 128) if b >= min(rows, 128)][:2]
    tiles = []
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in (128, 256):
                for stages in (3, 5):
                    if (bm + bn) * bk * stages > 200 * 1024 or k % bk:
                        continue
                    warps = 8 if bm * bn >= 128 * 128 else 4
                    for split in ((1, 2, 4) if n <= k else (1,)):
                        if k % (split * bk) == 0:
                            tiles.append((bm, bn, bk, stages, warps, split))
    return tiles


def sweep_tma(model: str, rows_list: list[int]) -> None:
    """--tma's lines: microseconds of each way to take a per-channel fp8 product at each row count."""
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    for name, (N, K) in SHAPES[model].items():
        copies = max(1, -(-150_000_000 // (N * K)))
        weights = [quantize_weight_ref(torch.randn(N, K, device="cuda") * 0.02) for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            q, s = quantize(x)
            line = {"gpu": gpu, "model": model, "product": name, "N": N, "K": K, "rows": rows, "copies": copies}
            line["cublas_us"] = round(time_over_copies_us(lambda i: lambda: torch._scaled_mm(
                q, weights[i][0].t(), scale_a=s, scale_b=weights[i][1].view(1, -1), out_dtype=torch.bfloat16),
                copies), 2)
            line["rule_us"] = round(time_over_copies_us(lambda i: lambda: fp8_gemm_module.fp8_product(
                q, s, *weights[i], None, None, torch.bfloat16), copies), 2)
            timed = []
            for tile in candidate_tiles(rows, False):
                try:
                    timed.append((time_over_copies_us(
                        lambda i: lambda: fp8_gemm(q, s, *weights[i], None, torch.bfloat16, tile), copies), tile))
                except Exception:  # (out of shared memory)
                    continue
            line["pointer_best_us"], line["pointer_best_tile"] = min(timed)
            want = fp8_gemm(q, s, *weights[0], None, torch.bfloat16).float()
            timed, worst = [], 0.0
            for tile in tma_tiles(rows, N, K):
                def call(i, tile=tile):
                    return lambda: tile_gemm_triton(q, weights[i][0], parts_ok=tile[5] > 1, tile=tile, x_scale=s,
                                                    weight_scale=weights[i][1])
                try:
                    got = call(0)()
                    got = got.sum(0) if tile[5] > 1 else got.float()
                    worst = max(worst, float((got - want).abs().max() / want.abs().max()))
                    timed.append((time_over_copies_us(call, copies), tile))
                except Exception as e:  # (out of resources)
                    print(json.dumps({"tile": tile, "error": repr(e)[:160]}), flush=True)
            timed.sort()
            line["tma_best_us"], line["tma_best_tile"] = timed[0]
            line["tma_next"] = [(round(us, 2), tile) for us, tile in timed[1:4]]
            line["tma_best_unsplit"] = next(((round(us, 2), t) for us, t in timed if t[5] == 1), None)
            line["tma_worst_rel_err"] = worst
            print(json.dumps(line), flush=True)
        del weights
        torch.cuda.empty_cache()


def candidate_tiles(rows: int, blocks: bool) -> list[tuple]:
    ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)][-3:]
    tiles = []
    for bm in ms:
        for bn in (32, 64, 128):
            for bk in ((128,) if blocks else (128, 256)):
                for stages in (3, 5):
                    tiles.append((bm, bn, bk, 8 if bm * bn >= 64 * 128 else 4, stages))
    return tiles


if __name__ == "__main__":
    main()
