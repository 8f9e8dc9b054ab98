"""Throughput on one GPU: BENCHMARKS.md's workloads through batchgen and, in the same run on the same
GPU, HF transformers generate() (batches of 64 in input order, left padding, each batch run to its
longest requested output, only requested tokens counted). Random weights at real shapes, built here
with transformers and saved as bf16 safetensors. Prints one JSON line per measurement.

    python benchmarks/throughput.py --model llama-3.2-1b --workload W-offline W-short --hf-requests 64 \
        --json-out results.jsonl --plot throughput.png

W-prefix runs with the prefix cache on and off (ratio_vs_cache_off); W-n runs its n = 8 samples a
prompt against the same job as separate rows with the cache off (ratio_vs_separate_rows), as
before either existed. --compare-cache-off adds a cache-off run to any other workload.

GPU busy is the mean of NVML's utilization samples (the share of time a kernel was running) taken
every 50 ms during batchgen's run.

W-json is W-short's requests (lengths, token-id prompts) with max_tokens 64 and a small JSON schema on
every row (response_format); it is compared with the same requests unconstrained, each row's
max_tokens set to what it generated under the schema (rows end when their grammar completes), so
both runs generate the same tokens. Its line adds the unconstrained run, their ratio and the host
time per constrained step spent filling token masks and accepting the sampled tokens (while the GPU
runs the step's forward).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen import LLM, SamplingParams  # noqa: E402

MODELS = {
    "llama-3.2-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=32768)),
    "llama-3.1-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072)),
}
# name: (requests, input range, output range)
WORKLOADS = {
    "W-offline": (256, (100, 1024), (100, 1024)),
    "W-short": (2048, (32, 256), (16, 128)),
    "W-long": (64, (4096, 8192), (64, 256)),
    "W-decode1": (1, (128, 128), (1024, 1024)),
    "W-prefix": (2048, (32, 256), (16, 128)),  # + a shared 1,024-token system prompt in front of every row
    "W-n": (256, (100, 1024), (100, 512)),  # n = 8 samples of each prompt
    "W-json": (2048, (32, 256), (64, 64)),
}
SYSTEM_PROMPT_TOKENS = 1024  # W-prefix
SAMPLES = 8  # W-n
# W-json's schema: a label from 5 and a confidence
JSON_SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["alpha", "beta", "gamma", "delta", "epsilon"]}, "confidence": {"type": "number"}},
    "required": ["label", "confidence"]}


def build_model(name: str, root: Path) -> Path:
    path = root / name
    if (path / "config.json").exists():
        return path
    import transformers as tf

    from tests.tiny_models import save_tokenizer

    cls, shape = MODELS[name]
    config = getattr(tf, cls)(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(path)
    del model
    torch.cuda.empty_cache()
    return path


def make_requests(workload: str, vocab: int) -> list[dict]:
    n, (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[workload]
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(SYSTEM_PROMPT_TOKENS)] if workload == "W-prefix" else []
    requests = [
        {"id": i, "prompt_token_ids": system + [rng.randrange(vocab) for _ in range(rng.randint(in_lo, in_hi))],
         "max_tokens": rng.randint(out_lo, out_hi)}
        for i in range(n)
    ]
    if workload == "W-n":
        requests = [{**r, "n": SAMPLES} for r in requests]
    if workload == "W-json":
        format = {"type": "json_schema", "json_schema": {"name": "label", "schema": JSON_SCHEMA}}
        requests = [{**r, "response_format": format} for r in requests]
    return requests


def as_separate_rows(requests: list[dict]) -> list[dict]:
    """A job of n samples a row as the same number of rows of one sample each."""
    rows = [{**r, "n": 1} for r in requests for _ in range(r.get("n", 1))]
    return [{**r, "id": i} for i, r in enumerate(rows)]


class GpuBusy:
    """Samples NVML's GPU utilization in a thread while the block runs."""

    def __enter__(self):
        import threading

        self.samples, self._stop = [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # no NVML here: report nothing rather than fail the benchmark
            return self

        def sample():
            while not self._stop.wait(0.05):
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    @property
    def percent(self):
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def run_batchgen(model_dir: Path, requests: list[dict], temperature: float, tp: int = 1, **options) -> dict:
    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=tp, **options)
    params = SamplingParams(temperature=temperature, ignore_eos=True)
    # warm-up: kernels compiled, allocator primed, schema compiled
    llm.generate_list([{**r, "n": 1} for r in requests[:2]], params)
    if llm.engine.scheduler.cache is not None:
        llm.engine.scheduler.cache.clear()  # the measured run starts from an empty prefix cache
    torch.cuda.synchronize()
    structured = llm.engine.structured
    structured.mask_seconds, structured.accept_seconds, structured.mask_steps = 0.0, 0.0, 0
    with GpuBusy() as busy:
        start = time.perf_counter()
        results = llm.generate_list(requests, params)
        wall = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    constrained = any("response_format" in r for r in requests)
    assert all(r["error"] is None for r in results)
    # (a grammar may end a row early)
    assert tokens == sum(r["max_tokens"] * r.get("n", 1) for r in requests) or constrained
    ttft = sorted(r["ttft_s"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    hit_rate = sum(r["cached_prompt_tokens"] for r in results) / prompt_tokens if prompt_tokens else 0.0
    del llm
    torch.cuda.empty_cache()
    out = {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens, "ttft_p50_s": ttft[len(ttft) // 2],
           "gpu_busy_pct": busy.percent, "prefix_cache_hit_rate": round(hit_rate, 4),
           "completion_tokens": [r["completion_tokens"] for r in results]}
    if structured.mask_steps:
        out["mask_ms_per_step"] = 1000 * structured.mask_seconds / structured.mask_steps
        out["accept_ms_per_step"] = 1000 * structured.accept_seconds / structured.mask_steps
    return out


def run_hf(model_dir: Path, requests: list[dict], batch_size: int = 64) -> dict:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    tokens = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):  # left padding
            n = len(r["prompt_token_ids"])
            ids[j, width - n :] = torch.tensor(r["prompt_token_ids"])
            mask[j, width - n :] = 1
        longest = max(r["max_tokens"] for r in chunk)
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        tokens += sum(r["max_tokens"] for r in chunk)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens}


def plot(lines: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{d['model']}\n{d['workload']}" + (f" tp{d['tp']}" if d.get("tp", 1) > 1 else "") for d in lines]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(lines)), 4))
    x = range(len(lines))
    ax.bar([i - 0.2 for i in x], [d["batchgen_tok_s"] for d in lines], 0.4, label="batchgen")
    ax.bar([i + 0.2 for i in x], [d.get("hf_generate_tok_s", 0) for d in lines], 0.4, label="HF generate()")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"batchgen vs HF transformers, {lines[0]['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), nargs="+", default=["llama-3.2-1b"])
    ap.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=["W-offline"])
    ap.add_argument("--hf-requests", type=int, default=0, help="run HF generate() on the first N requests")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--models-dir", default="/tmp/batchgen-bench-models")
    ap.add_argument("--compare-cache-off", action="store_true",
                    help="also run each workload with the prefix cache off (always done for W-prefix)")
    ap.add_argument("--json-out", help="append the JSON lines to this file")
    ap.add_argument("--plot", help="write a PNG bar chart of this run's lines")
    args = ap.parse_args(argv)
    lines = []
    for name in args.model:
        model_dir = build_model(name, Path(args.models_dir))
        for workload in args.workload:
            requests = make_requests(workload, MODELS[name][1]["vocab_size"])
            ours = run_batchgen(model_dir, requests, args.temperature, args.tensor_parallel_size)
            line = {"workload": workload, "model": name, "gpu": torch.cuda.get_device_name(),
                    "tp": args.tensor_parallel_size, "torch": torch.__version__, "requests": len(requests),
                    "temperature": args.temperature, "batchgen_tok_s": round(ours["tok_s"], 1),
                    "batchgen_wall_s": round(ours["wall_s"], 2), "batchgen_ttft_p50_s": round(ours["ttft_p50_s"], 3),
                    "gpu_busy_pct": ours["gpu_busy_pct"], "prefix_cache_hit_rate": ours["prefix_cache_hit_rate"]}
            if workload == "W-prefix" or args.compare_cache_off:
                off = run_batchgen(model_dir, requests, args.temperature, args.tensor_parallel_size,
                                   enable_prefix_caching=False)
                line.update({"cache_off_tok_s": round(off["tok_s"], 1), "cache_off_wall_s": round(off["wall_s"], 2),
                             "ratio_vs_cache_off": round(ours["tok_s"] / off["tok_s"], 3)})
            if workload == "W-n":
                rows = run_batchgen(model_dir, as_separate_rows(requests), args.temperature, args.tensor_parallel_size,
                                    enable_prefix_caching=False)
                line.update({"samples": SAMPLES, "separate_rows_tok_s": round(rows["tok_s"], 1),
                             "separate_rows_wall_s": round(rows["wall_s"], 2),
                             "ratio_vs_separate_rows": round(ours["tok_s"] / rows["tok_s"], 3)})
            if workload == "W-decode1":
                line["ms_per_token"] = round(1000 / ours["tok_s"], 3)
            if workload == "W-json":  # the same rows and output lengths, unconstrained
                free = [{"id": r["id"], "prompt_token_ids": r["prompt_token_ids"], "max_tokens": n}
                        for r, n in zip(requests, ours["completion_tokens"])]
                base = run_batchgen(model_dir, free, args.temperature, args.tensor_parallel_size)
                line.update({"mask_ms_per_step": round(ours.get("mask_ms_per_step", 0.0), 3),
                             "accept_ms_per_step": round(ours.get("accept_ms_per_step", 0.0), 3),
                             "ended_by_grammar": sum(n < 64 for n in ours["completion_tokens"]),
                             "unconstrained_tok_s": round(base["tok_s"], 1),
                             "json_ratio": round(ours["tok_s"] / base["tok_s"], 3)})
            if args.hf_requests:
                hf = run_hf(model_dir, as_separate_rows(requests)[: args.hf_requests])
                line.update({"hf_requests": min(args.hf_requests, len(requests)),
                             "hf_generate_tok_s": round(hf["tok_s"], 1), "hf_wall_s": round(hf["wall_s"], 2),
                             "ratio": round(ours["tok_s"] / hf["tok_s"], 2)})
            print(json.dumps(line), flush=True)
            lines.append(line)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps(line) + "\n")
    if args.plot and lines:
        plot(lines, args.plot)


if __name__ == "__main__":
    main()
