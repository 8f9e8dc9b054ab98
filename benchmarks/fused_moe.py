"""The fused MoE (batchgen/kernels/fused_moe.py) on a GPU at the layers of qwen3-30b-a3b (E 128, k 8,
H 2048, I 768) and mixtral-8x7b (E 8, k 2, H 4096, I 14336), bf16, T in 1 .. 4096 tokens; --fp8 channel or
block also times FP8 experts (e4m3 weights with per-channel or 128x128-block scales, inputs rounded per token
or per 128-group; kernels/fused_moe.Fp8Experts), "bf16" the 16-bit layer (the default).

    PYTHONPATH=. python benchmarks/fused_moe.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,16,...]
        [--tp 1,2] [--fp8 bf16,channel,block] [--tune]

For each T: the router's weights and ids from random logits, the fused MoE checked against
fused_moe_reference, then timed with CUDA events (warm-up first: Triton compiles are not timed):
  us        a CUDA graph of the layer's calls on `copies` distinct copies of its weights, replayed (as the
            engine runs a step: no launch cost, a call's weights not in the L2 from the call before),
            per call;
  us_eager  one eager call (with Python's launch cost of the align, two products and the sum);
  ref_us    fused_moe_reference, eager;
  align_us  the align alone in a graph: the Triton kernels and the torch ops (`us` includes the one
            moe_align picks);
  router_us select_experts alone in a graph (not in `us`); router_torch_us its torch ops (the CPU's path).
Bytes are the touched experts' weights read once (distinct experts hit * 3 * H * I * 2, or * 1 for fp8) plus x read and
the output written; GB/s is those over `us`, bw_frac over the GPU's bandwidth (H200 4.8 TB/s, H100
3.35 TB/s, by torch.cuda.get_device_name). The issue's target: T = 256 at >= 0.70 of it.

--tune also sweeps BLOCK_M and each product's (BLOCK_N, BLOCK_K, warps, stages) per T (each product
timed alone on the same aligned slots; the best pair then timed together per BLOCK_M) and prints the
best configs as entries of moe_config.TUNED (TUNED_FP8 for an fp8 form) to paste into kernels/moe_config.py. One
JSON line per measurement; a table last. --tp 2 times the shard of I a GPU holds under tensor parallelism;
with --expert-parallel, the E / tp experts a GPU holds whole instead (rank 0's: the pairs routed to others
given no slot, the sum over its own pairs; bytes count its touched experts).
"""
import argparse
import itertools
import json
import statistics

import torch

import batchgen.kernels.fused_moe as fm
from batchgen.kernels.fp8_gemm import quantize
from batchgen.kernels.fused_moe import (
    fused_moe_reference,
    fused_moe_triton,
    quantize_experts,
)
from batchgen.kernels.moe_align import moe_align_torch, moe_align_triton
from batchgen.kernels.moe_config import GemmTile, MoeConfig, pick_config
from batchgen.kernels.moe_router import select_experts, select_experts_torch

MODELS = {
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, inter=768, copies=4),
    "mixtral-8x7b": dict(num_experts=8, top_k=2, hidden=4096, inter=14336, copies=2),
}
TOKENS = [1, 16, 64, 256, 1024, 4096]
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s
DTYPE = torch.bfloat16
DEVICE = "cuda"
TOLERANCE = dict(atol=3e-2, rtol=3e-2)
REPS = 20
SHARED_MEMORY = 200 * 1024  # a candidate's pipelined tiles must fit in this (Hopper: 227 KB a block)

# the sweep: BLOCK_M, and per product (BLOCK_N, BLOCK_K) x (warps, stages)
BLOCK_MS = [16, 32, 64, 128]
NK_TILES = [(32, 128), (64, 64), (64, 128), (128, 64), (128, 128)]
WARPS_STAGES = [(4, 3), (4, 4), (8, 3), (8, 4)]

RECORDS = []


def emit(**record):
    RECORDS.append(record)
    print(json.dumps(record), flush=True)


def bandwidth() -> float | None:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def make_layer(num_experts, hidden, inter, copies, form="bf16", **_):
    """copies distinct (w13, w2, fp8) of one layer (fp8 None for bf16): a graph cycles through them so no
    call finds its weights in the L2."""
    layers = []
    for _ in range(copies):
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=DTYPE) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=DTYPE) / inter**0.5
        layers.append((w13, w2, None) if form == "bf16" else quantize_experts(w13, w2, form == "block"))
    return layers


def make_batch(num_tokens, num_experts, top_k, hidden, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, device=DEVICE), top_k, True)
    return x, weights, ids


def graph_us(calls) -> float:
    """Median over REPS replays of one CUDA graph of calls (a list of no-argument functions), per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and the allocator's warm-up, outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def eager_us(call, reps=REPS) -> float:
    call()  # warm-up (compiles)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def touched_bytes(experts_hit, num_tokens, hidden, inter, weight_bytes=2) -> int:
    return experts_hit * 3 * hidden * inter * weight_bytes + 2 * num_tokens * hidden * 2


def bench(model, shape, layers, num_tokens, peak, form="bf16"):
    x, weights, ids = make_batch(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"])
    w13, w2, fp8 = layers[0]
    shard = dict(routed_experts=shape["num_experts"])  # (rank 0's experts: the first w13.shape[0])
    got = fused_moe_triton(x, w13, w2, weights, ids, fp8=fp8, **shard)
    want = fused_moe_reference(x, w13, w2, weights, ids, fp8)
    max_err = (got.float() - want.float()).abs().max().item()
    ok = close_to(got, want, form)
    us = graph_us([lambda w13=w13, w2=w2, fp8=fp8: fused_moe_triton(x, w13, w2, weights, ids, fp8=fp8, **shard)
                   for w13, w2, fp8 in layers])
    us_eager = eager_us(lambda: fused_moe_triton(x, w13, w2, weights, ids, fp8=fp8, **shard))
    ref_us = eager_us(lambda: fused_moe_reference(x, w13, w2, weights, ids, fp8), reps=3)
    config = pick_config(num_tokens, shape["hidden"], shape["inter"], shape["num_experts"], shape["top_k"],
                            x.device, fp8=None if form == "bf16" else form)
    local = w13.shape[0]  # (rank 0's experts under --expert-parallel, else all)
    align_triton = graph_us([lambda: moe_align_triton(ids, local, config.block_m)] * 8)
    align_torch = graph_us([lambda: moe_align_torch(ids, local, config.block_m)] * 8)
    logits = torch.randn(num_tokens, shape["num_experts"], device=DEVICE)
    router = graph_us([lambda: select_experts(logits, shape["top_k"], True)] * 8)
    router_torch = graph_us([lambda: select_experts_torch(logits, shape["top_k"], True)] * 8)
    hit = (ids.unique() < local).sum().item()
    nbytes = touched_bytes(hit, num_tokens, shape["hidden"], shape["inter"], 2 if fp8 is None else 1)
    record = dict(model=model, form=form, inter=shape["inter"], experts=local, T=num_tokens, experts_hit=hit,
                  mbytes=round(nbytes / 1e6, 1), us=round(us, 1), us_eager=round(us_eager, 1),
                  ref_us=round(ref_us, 1), align_triton_us=round(align_triton, 1),
                  align_torch_us=round(align_torch, 1), router_us=round(router, 1),
                  router_torch_us=round(router_torch, 1), gbps=round(nbytes / us / 1e3, 1),
                  ref_gbps=round(nbytes / ref_us / 1e3, 1), max_err=round(max_err, 4), ok=ok,
                  config=repr(tuple(config)))
    if peak:
        record["bw_frac"] = round(nbytes / (us * 1e-6) / peak, 3)
        record["ref_bw_frac"] = round(nbytes / (ref_us * 1e-6) / peak, 4)
    emit(**record)


def fits(block_m: int, tile: GemmTile, weight_tiles: int, itemsize: int = 2) -> bool:
    """The pipelined tiles of x and W (weight_tiles of them: gate and up, or down) in shared memory."""
    per_stage = (block_m * tile.block_k + weight_tiles * tile.block_n * tile.block_k) * itemsize
    return per_stage * tile.stages <= SHARED_MEMORY


def candidate_tiles(block_m, weight_tiles, form="bf16"):
    nk_tiles = NK_TILES if form == "bf16" else [(n, 2 * k) for n, k in NK_TILES if form == "channel" or 2 * k <= 128]
    tiles = [GemmTile(n, k, w, s) for (n, k), (w, s) in itertools.product(sorted(set(nk_tiles)), WARPS_STAGES)]
    return [t for t in tiles if fits(block_m, t, weight_tiles, 2 if form == "bf16" else 1)]


def best_of(tiles, make_call, layers):
    """The fastest tile (graph-timed over the layer copies) and its time; a tile that fails to compile
    or run is skipped."""
    best = (float("inf"), None)
    for tile in tiles:
        try:
            us = graph_us([make_call(tile, w13, w2, fp8) for w13, w2, fp8 in layers])
        except Exception as e:  # (out of resources at compile)
            emit(tune_error=repr(tile), error=repr(e)[:200])
            continue
        best = min(best, (us, tile))
    return best


def close_to(got, want, form) -> bool:
    """bf16: allclose; fp8: a value of h may round one e4m3 step apart (tests/gpu/test_fused_moe_gpu.py)."""
    if form == "bf16":
        return torch.allclose(got.float(), want.float(), **TOLERANCE)
    return bool((got.float() - want.float()).abs().mean() < 0.01 * want.float().abs().mean())


def tune(model, shape, layers, num_tokens, form="bf16") -> MoeConfig | None:
    """The fastest config at num_tokens, each BLOCK_M's best tiles checked against the reference."""
    x, weights, ids = make_batch(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"])
    w13, w2, fp8 = layers[0]
    want = fused_moe_reference(x, w13, w2, weights, ids, fp8)
    x_in, x_scale = (x, None) if fp8 is None else quantize(x, group=fp8.group)
    start = pick_config(num_tokens, shape["hidden"], shape["inter"], shape["num_experts"], shape["top_k"], x.device,
                        fp8=None if fp8 is None else fp8.form)  # (the gate/up tile that makes down's input)
    per_expert = num_tokens * shape["top_k"] / shape["num_experts"]
    best = (float("inf"), None)
    for block_m in [m for m in BLOCK_MS if m == 16 or m <= 4 * per_expert]:
        aligned = moe_align_torch(ids, shape["num_experts"], block_m)
        h = fm.gate_up_silu(x_in, w13, shape["top_k"], aligned, block_m, start.gate_up, fp8, x_scale, x.dtype)
        h_in, h_scale = (h, None) if fp8 is None else quantize(h, group=fp8.group)
        gate_up_us, gate_up = best_of(
            candidate_tiles(block_m, 2, form),
            lambda tile, w13, w2, fp8: lambda: fm.gate_up_silu(x_in, w13, shape["top_k"], aligned, block_m, tile,
                                                               fp8, x_scale, x.dtype), layers)
        down_us, down = best_of(
            candidate_tiles(block_m, 1, form),
            lambda tile, w13, w2, fp8: lambda: fm.down_weighted(h_in, w2, weights, aligned, block_m, tile, fp8,
                                                                h_scale, x.dtype), layers)
        if gate_up is None or down is None:
            continue
        config = MoeConfig(block_m, gate_up, down)
        got = fused_moe_triton(x, w13, w2, weights, ids, config, fp8=fp8)
        if not close_to(got, want, form):
            emit(model=model, T=num_tokens, config=repr(tuple(config)), error="differs from the reference")
            continue
        us = graph_us([lambda w13=w13, w2=w2, fp8=fp8: fused_moe_triton(x, w13, w2, weights, ids, config, fp8=fp8)
                       for w13, w2, fp8 in layers])
        emit(model=model, form=form, inter=shape["inter"], T=num_tokens, block_m=block_m,
             gate_up_us=round(gate_up_us, 1), down_us=round(down_us, 1), us=round(us, 1), config=repr(tuple(config)))
        best = min(best, (us, config))
    return best[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--tp", default="1", help="tensor-parallel degrees: a GPU holds I / tp of each expert")
    parser.add_argument("--fp8", default="bf16", help="the experts' forms: bf16, channel, block (comma-separated)")
    parser.add_argument("--tune", action="store_true", help="sweep the block sizes and print TUNED's entries")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="under --tp N a GPU holds E / N experts whole, not I / N of each")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.tune and args.expert_parallel:  # (a GPU's experts get the pairs they get on one: the whole model's table)
        parser.error("--tune tunes the whole model's shape; leave out --expert-parallel")
    forms = args.fp8.split(",")
    if set(forms) - {"bf16", "channel", "block"}:
        parser.error("--fp8 takes bf16, channel and block")
    peak = bandwidth()
    device_name = torch.cuda.get_device_name()
    tokens = [int(t) for t in args.tokens.split(",")]
    tuned = {}
    for model, tp, form in itertools.product(args.models.split(","), [int(t) for t in args.tp.split(",")], forms):
        shape = dict(MODELS[model])
        experts = shape["num_experts"]  # a GPU's
        if args.expert_parallel:
            experts //= tp
        else:
            shape["inter"] //= tp
        layers = make_layer(**{**shape, "num_experts": experts}, form=form)
        for num_tokens in tokens:
            bench(model, shape, layers, num_tokens, peak, form)
            if args.tune:
                config = tune(model, shape, layers, num_tokens, form)
                if config is not None:
                    key = (device_name, shape["hidden"], shape["inter"], shape["num_experts"], shape["top_k"])
                    tuned.setdefault(key if form == "bf16" else (*key, form), {})[num_tokens] = config
        del layers
        torch.cuda.empty_cache()
    print(f"\n{'model':<15}{'form':>8}{'I':>6}{'T':>6}{'hit':>5}{'MB':>9}{'us':>9}{'eager':>9}{'GB/s':>8}{'frac':>7}"
          f"{'ref us':>10}{'align us (triton/torch)':>26}{'router':>8}  ok")
    for r in RECORDS:
        if "us_eager" in r:
            print(f"{r['model']:<15}{r['form']:>8}{r['inter']:>6}{r['T']:>6}{r['experts_hit']:>5}{r['mbytes']:>9}{r['us']:>9}"
                  f"{r['us_eager']:>9}{r['gbps']:>8}{r.get('bw_frac', '-'):>7}{r['ref_us']:>10}"
                  f"{r['align_triton_us']:>15} / {r['align_torch_us']:<8}{r['router_us']:>8}  {r['ok']}")
    if tuned:
        print("\n# moe_config.TUNED entries (benchmarks/fused_moe.py --tune; keys ending in a form: TUNED_FP8's):")
        for key, by_tokens in tuned.items():
            print(f"    {key!r}: {{")
            for num_tokens, config in sorted(by_tokens.items()):
                print(f"        {num_tokens}: {config!r},")
            print("    },")


if __name__ == "__main__":
    main()
