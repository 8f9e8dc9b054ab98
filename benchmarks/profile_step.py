"""Where the time goes in the step loop: one workload of benchmarks/throughput.py under cProfile
(after a warm-up job), the top functions by own time and the step count; with --kernels, the top
GPU kernels by total time over steps 100-199 of the job, or over the whole job with --steps all
(torch profiler). --kernels runs with programmatic dependent launch off unless --pdl on: under PDL a
kernel starts before the one it follows ends and waits for it, so the table would charge the wait
to the later kernel.

    python benchmarks/profile_step.py --model llama-3.2-1b --workload W-short [--kernels [--steps all]] [-tp N]
        [--expert-parallel] [--batch-invariant] [--kv-cache-dtype fp8] [--quantization fp8] [--load-format dummy]
        [--pdl on|off]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen import LLM, SamplingParams  # noqa: E402
from benchmarks.throughput import MODELS, WORKLOADS, build_model, make_requests  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="llama-3.2-1b")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="W-short")
    ap.add_argument("--models-dir", default="/tmp/batchgen-bench-models")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--kernels", action="store_true", help="GPU kernel times instead of the host profile")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="profile rank 0 of a tensor-parallel engine (its host loop, or its GPU's kernels)")
    ap.add_argument("--steps", default="100:200", help="steps profiled with --kernels: FIRST:END or all")
    ap.add_argument("--batch-invariant", action="store_true", help="profile the --batch-invariant mode")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the KV pool's dtype")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="quantize the weights at load")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights from the shape alone (no checkpoint written)")
    ap.add_argument("--expert-parallel", action="store_true", help="MoE models under -tp N: whole experts a GPU")
    ap.add_argument("--pdl", choices=["on", "off"], default=None,
                    help="programmatic dependent launch (default: on, off with --kernels; the module's docstring)")
    args = ap.parse_args(argv)
    pdl = args.pdl == "on" if args.pdl else not args.kernels
    model_dir = build_model(args.model, Path(args.models_dir), weights=args.load_format != "dummy")
    requests = make_requests(args.workload, MODELS[args.model][1]["vocab_size"])
    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=args.tensor_parallel_size,
              batch_invariant=args.batch_invariant, pdl=pdl, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, load_format=args.load_format, expert_parallel=args.expert_parallel)
    try:
        profile(llm, requests, args)
    finally:
        llm.close()  # (stops the tensor-parallel workers)


def profile(llm, requests, args) -> None:
    params = SamplingParams(temperature=0.6, ignore_eos=True)
    llm.generate_list(requests[:2], params)
    if args.kernels:
        return profile_kernels(llm, requests, params, args.top, args.steps)
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    results = llm.generate_list(requests, params)
    profiler.disable()
    wall = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    print(f"PROFILE {args.model} {args.workload}: {steps} steps, {wall:.2f}s under cProfile "
          f"({1000 * wall / steps:.2f} ms/step), {tokens / wall:.0f} tok/s")


def profile_kernels(llm, requests, params, top: int, steps: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    if steps == "all":
        with prof:
            llm.generate_list(requests, params)
            torch.cuda.synchronize()
    else:
        first, end = (int(s) for s in steps.split(":"))
        step, seen = llm.engine.step, [0]

        def window():
            seen[0] += 1
            if seen[0] == first:
                prof.start()
            out = step()
            if seen[0] == end - 1:
                torch.cuda.synchronize()
                prof.stop()
            return out

        llm.engine.step = window
        llm.generate_list(requests, params)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))


if __name__ == "__main__":
    main()
