"""The default job on CPU: the 64 chat prompts of examples/prompts.jsonl, 64 new tokens at most,
greedy, on the embedded default model (SmolLM2-135M-Instruct): batchgen against HF transformers
generate() in the same run on the same CPU.

HF baseline as BENCHMARKS.md describes it: batches of 64 in input order, left padding, each batch
run until every row has hit EOS or its 64 tokens; only the tokens each row really produced (up to
and including its EOS) count, the same as batchgen's completion_tokens. HF loads the checkpoint in
its own dtype (fp32); batchgen runs at its automatic dtype (bf16 on CPUs with native bf16) and, for
reference, in fp32 too. Each side runs in a process of its own (HF as a user runs it: batchgen's
CPU tuning of the process, executor/cpu_memory.py, stays in batchgen's processes), --repeats times,
alternating, and its best run counts: other work on a small machine only ever slows a run down.
Prints one JSON line per batchgen setting.

--busy N starts N processes that keep a core busy each (`while True: pass`) for the whole run: a
shared machine, where torch's threads compete with other work (executor/cpu_threads.py). Both sides
run under the same load; batchgen's runs report the thread count it chose. --cpu-threads passes
EngineConfig.cpu_threads (default: auto). On a CPU without native bf16, auto is fp32 and runs once.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import time
from pathlib import Path

import torch

from batchgen import LLM, SamplingParams
from batchgen.executor.cpu_threads import usable_cores
from batchgen.executor.memory import cpu_has_native_bf16

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"


def load_prompts(n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    return [r["messages"] for r in rows[:n]]


def batchgen_runner(dtype: str, prompts, max_tokens: int, cpu_threads: int | None):
    llm = LLM(device="cpu", dtype=dtype, cpu_threads=cpu_threads)
    rows = [{"id": i, "messages": m} for i, m in enumerate(prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate_list(rows[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up

    def run() -> dict:
        start = time.perf_counter()
        results = llm.generate_list(rows, params)
        wall = time.perf_counter() - start
        tokens = sum(r["completion_tokens"] for r in results)
        return {"dtype": llm.describe()["dtype"], "tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                "threads": torch.get_num_threads()}

    return llm.engine.model_dir, run


def hf_runner(model_dir, prompts, max_tokens: int, batch_size: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]

    def run() -> dict:
        tokens = 0
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                ends = [j for j, t in enumerate(row) if t in eos]
                tokens += ends[0] + 1 if ends else len(row)
        wall = time.perf_counter() - start
        return {"dtype": str(model.dtype).removeprefix("torch."), "tok_s": tokens / wall, "wall_s": wall,
                "tokens": tokens, "threads": torch.get_num_threads()}

    return run


def serve(kind: str, prompts, args, model_dir, conn) -> None:
    """One side in its own process: build it, then run the job each time the parent asks."""
    if kind == "hf":
        run = hf_runner(model_dir, prompts, args.max_tokens, args.hf_batch_size)
    else:
        model_dir, run = batchgen_runner(kind, prompts, args.max_tokens, args.cpu_threads)
    conn.send(str(model_dir))
    while conn.recv():
        conn.send(run())


def start(kind: str, args, prompts, model_dir=None):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(kind, prompts, args, model_dir, there), daemon=True)
    proc.start()
    return proc, here, here.recv()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--busy", type=int, default=0, help="processes that keep a core busy each, for the whole run")
    ap.add_argument("--cpu-threads", type=int, default=None, help="batchgen's cpu_threads (default: auto)")
    args = ap.parse_args()
    prompts = load_prompts(args.prompts)
    ctx = mp.get_context("spawn")
    busy = [ctx.Process(target=keep_a_core_busy, daemon=True) for _ in range(args.busy)]
    for proc in busy:
        proc.start()
    try:
        runs = run_sides(args, prompts)
    finally:
        for proc in busy:
            proc.kill()
    best = {name: max(results, key=lambda r: r["tok_s"]) for name, results in runs.items()}
    hf = best.pop("hf")
    for name, o in best.items():
        print(json.dumps({
            "workload": f"default job on CPU ({len(prompts)} chat prompts, <= {args.max_tokens} tokens, greedy)",
            "model": "SmolLM2-135M-Instruct", "cpu": platform.processor() or platform.machine(),
            "busy_processes": args.busy, "cores": usable_cores(), "batchgen_threads": o["threads"],
            "hf_threads": hf["threads"], "torch": torch.__version__,
            "batchgen_dtype": o["dtype"], "batchgen_tok_s": round(o["tok_s"], 1), "batchgen_s": round(o["wall_s"], 2),
            "batchgen_tokens": o["tokens"], "hf_dtype": hf["dtype"], "hf_generate_tok_s": round(hf["tok_s"], 1),
            "hf_generate_s": round(hf["wall_s"], 2), "hf_tokens": hf["tokens"],
            "ratio": round(o["tok_s"] / hf["tok_s"], 2),
            "runs": {name: [round(r["tok_s"], 1) for r in results] for name, results in runs.items()},
            # each repeat's runs are neighbours in time, under about the same load from elsewhere
            "repeat_ratios": [round(a["tok_s"] / b["tok_s"], 2) for a, b in zip(runs[name], runs["hf"])],
        }), flush=True)


def keep_a_core_busy() -> None:
    while True:
        pass


def run_sides(args, prompts) -> dict[str, list[dict]]:
    """Start each side in its process, then run them in turn, args.repeats times -> runs by side."""
    sides = {}
    first = "auto" if cpu_has_native_bf16() else "float32"  # (auto is fp32 there: run it once)
    sides[first] = start(first, args, prompts)
    sides["hf"] = start("hf", args, prompts, sides[first][2])
    if first == "auto":
        sides["float32"] = start("float32", args, prompts)
    runs = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, (_, conn, _) in sides.items():
            conn.send(True)
            runs[name].append(conn.recv())
    for proc, conn, _ in sides.values():
        conn.send(False)
        proc.join()
    return runs


if __name__ == "__main__":
    main()
