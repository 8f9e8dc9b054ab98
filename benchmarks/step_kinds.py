"""Wall time of a workload's steps by kind: steps that carry prefill tokens (by size) and decode-only
steps (by rows). Where a tensor-parallel run loses against TP=1 shows here (benchmarks/KERNELS.md,
session 14). engine.step() launches step N+1, then reads step N back, so the time between two of its
returns is charged to the step read back (in a busy loop that is that step's GPU time).

    python benchmarks/step_kinds.py --model llama-3.1-8b --workload W-offline [-tp 2]

Prints one JSON line, "STEPS {...}".
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen import LLM, SamplingParams  # noqa: E402
from benchmarks.throughput import MODELS, WORKLOADS, build_model, make_requests  # noqa: E402

DECODE_ROWS = (16, 64, 128, 192, 256)  # upper ends of the decode bins


def kind(num_decode: int, num_prefill: int) -> str:
    if num_prefill:
        return "prefill >=4096" if num_prefill >= 4096 else "prefill <4096"
    low = 1
    for high in DECODE_ROWS:
        if num_decode <= high:
            return f"decode {low}-{high}"
        low = high + 1
    return f"decode >{DECODE_ROWS[-1]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="llama-3.2-1b")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="W-offline")
    ap.add_argument("--requests", type=int, help="only the first N requests (smoke checks)")
    ap.add_argument("--models-dir", default="/tmp/batchgen-bench-models")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    args = ap.parse_args(argv)
    requests = make_requests(args.workload, MODELS[args.model][1]["vocab_size"])[: args.requests]
    llm = LLM(str(build_model(args.model, Path(args.models_dir))), dtype="bfloat16",
              tensor_parallel_size=args.tensor_parallel_size)
    try:
        print("STEPS " + json.dumps(time_steps(llm, requests, args)), flush=True)
    finally:
        llm.close()  # (stops the tensor-parallel workers)


def time_steps(llm, requests, args) -> dict:
    params = SamplingParams(temperature=0.6, ignore_eos=True)
    llm.generate_list(requests, params)  # warm-up: every graph size and kernel this job meets
    engine = llm.engine
    if engine.scheduler.cache is not None:
        engine.scheduler.cache.clear()  # (or the timed job would find its prompts cached)
    schedule, step = engine.scheduler.schedule, engine.step
    kinds, returns = [], []

    def scheduled():
        batch = schedule()
        kinds.append(None if batch is None else kind(batch.num_decode, batch.num_tokens - batch.num_decode))
        return batch

    def timed():
        finished = step()
        returns.append(time.perf_counter())
        return finished

    engine.scheduler.schedule, engine.step = scheduled, timed
    start = time.perf_counter()
    results = llm.generate_list(requests, params)
    wall = time.perf_counter() - start
    by_kind: dict[str, list] = {}
    # each step() call schedules once; the call after it reads that batch back
    for launched, (before, after) in zip(kinds, itertools.pairwise(returns)):
        if launched is not None:
            entry = by_kind.setdefault(launched, [0, 0.0])
            entry[0] += 1
            entry[1] += after - before
    tokens = sum(r["completion_tokens"] for r in results)
    return {"model": args.model, "workload": args.workload, "tp": args.tensor_parallel_size,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall), "steps": len(kinds),
            "kinds": {k: {"steps": n, "s": round(s, 3), "ms_per_step": round(1000 * s / n, 3)}
                      for k, (n, s) in sorted(by_kind.items())}}


if __name__ == "__main__":  # (tensor-parallel workers start by spawn and import this module)
    main()
