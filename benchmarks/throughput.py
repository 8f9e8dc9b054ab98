"""Throughput on one GPU: BENCHMARKS.md's workloads through batchgen and, in the same run on the same
GPU, HF transformers generate() (batches of 64 in input order, left padding, each batch run to its
longest requested output, only requested tokens counted). Random weights at real shapes, built here
with transformers and saved as bf16 safetensors, or with --load-format dummy only their config.json and
tokenizer (batchgen makes random weights itself: a 30B model's checkpoint is not written first; HF
generate() then runs a randomly initialized model). Prints one JSON line per measurement.

    python benchmarks/throughput.py --model llama-3.2-1b --workload W-offline W-short --hf-requests 64 \
        --json-out benchmarks/results/h200-$(date +%F).jsonl --plot docs/throughput-h200.png

(benchmarks/results/ holds one file of JSON lines per device and date; README names the files its tables use.)

--hf-continuous N runs the first N requests of each workload (the rows batchgen ran) through HF
transformers' continuous batching, the manager that generate_batch() runs, with its default attention
(paged sdpa, or flash attention where installed) and CUDA graph choice: greedy, each request to exactly
its max_tokens (EOS off), timed from the first request submitted to the last result after a warm-up.
The line adds hf_continuous_tok_s, hf_continuous_requests, hf_continuous_wall_s, hf_continuous_attention
and ratio_vs_hf_continuous (batchgen's tok/s over HF's):

    python benchmarks/throughput.py --model qwen3-30b-a3b --workload W-short --load-format dummy \
        --hf-continuous 512

W-prefix runs with the prefix cache on and off (ratio_vs_cache_off); W-n runs its n = 8 samples a
prompt against the same job as separate rows, with the cache off and on (ratio_vs_separate_rows,
ratio_vs_separate_rows_cache_on). --compare-cache-off adds a cache-off run to any other workload.
Each line reports start-up (weights, KV pool, kernel warm-up, graph captures) apart from the job;
--no-warm-up times the first job right after start-up (with a fresh TRITON_CACHE_DIR: a first run).

W-chat is a text job: chat `messages` through the tokenizer and chat template (SmolLM2's, from
benchmarks/chat_tokenizer/, copied into the model's directory), against the same rows given as the
token ids that template gives (`prompt_token_ids`), on the same engine, alternating, best of --repeats
each (user turns of 8-400 words: ~280 prompt tokens a row on average). A CPU smoke check of the script:
`--model smoke --workload W-chat --requests 4 --repeats 1` (its figures mean nothing).

GPU busy is the mean of NVML's utilization samples (the share of time a kernel was running) taken
every 50 ms during batchgen's run.

W-node is W-offline's lengths over 1,024 requests through --data-parallel-size replicas (each
--tensor-parallel-size GPUs) against one replica, in the same call: the ratio, each replica's rows,
tok/s and GPU busy, start-up against one's, and the imbalance at the end (the seconds between the
first and the last replica going idle).

--compare-fp8 adds, on the same rows: `--quantization fp8` (weights quantized per channel at load,
activations per token), the same with an fp8 KV pool, and the 128x128-block checkpoint form (written
here from the bf16 weights, as Qwen's and DeepSeek's FP8 checkpoints lay theirs out), each against bf16;
`--compare-fp8 block` runs only the variants named.

W-json is W-short's requests (lengths, token-id prompts) with max_tokens 64 and a small JSON schema on
every row (response_format); it is compared with the same requests unconstrained, each row's
max_tokens set to what it generated under the schema (rows end when their grammar completes), so
both runs generate the same tokens. Its line adds the unconstrained run, their ratio and the host
time per constrained step spent filling token masks and accepting the sampled tokens (while the GPU
runs the step's forward).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.config import LOAD_FORMATS  # noqa: E402
from batchgen.engine.request import chat_text  # noqa: E402

# a crash in native code (a segfault, an abort) still leaves its Python stack on the process's stderr (the
# original one: under pytest's capture sys.stderr has no file descriptor)
faulthandler.enable(file=sys.__stderr__)

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
    # mixtures of experts: run with --load-format dummy (their checkpoints are 61 and 93 GB)
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                      tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960)),
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                     vocab_size=32000, tie_word_embeddings=False, rope_theta=1000000.0,
                     max_position_embeddings=32768)),
    # not a benchmark: a model small enough to check the script on a CPU (its vocabulary holds the chat tokenizer's)
    "smoke": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096)),
}
# name: (requests, input range (W-chat: words of the user turn), output range)
FP8_VARIANTS = ("fp8", "fp8_kv", "block")
WORKLOADS = {
    "W-offline": (256, (100, 1024), (100, 1024)),
    "W-short": (2048, (32, 256), (16, 128)),
    "W-long": (64, (4096, 8192), (64, 256)),
    "W-decode1": (1, (128, 128), (1024, 1024)),
    "W-chat": (4096, (8, 400), (16, 256)),
    "W-prefix": (2048, (32, 256), (16, 128)),  # + a shared 1,024-token system prompt in front of every row
    "W-n": (256, (100, 1024), (100, 512)),  # n = 8 samples of each prompt
    "W-json": (2048, (32, 256), (64, 64)),
    "W-node": (1024, (100, 1024), (100, 1024)),  # data parallel: DP=N against DP=1 on the same rows
}
# W-json's schema: a label from 5 and a confidence
JSON_SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["alpha", "beta", "gamma", "delta", "epsilon"]}, "confidence": {"type": "number"}},
    "required": ["label", "confidence"]}
SYSTEM_PROMPT_TOKENS = 1024  # W-prefix
SAMPLES = 8  # W-n
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE_OPTIONS = {"load_format": "auto"}  # every engine's (main sets them from the command line)
CHAT_TOKENIZER = Path(__file__).resolve().parent / "chat_tokenizer"
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful editor. Answer in plain English, briefly, and say so when you are not sure.",
    "You are a support agent for a bicycle shop. Be friendly, ask for the model and year of the bike when it "
    "matters, and never promise a repair time you cannot keep.",
    "You summarize documents for busy readers: lead with the conclusion, then at most five short points, "
    "then any numbers that matter. Do not add facts that are not in the document.",
]
WORDS = (
    "the a of to and in is it that for on with as was at by this be from or have an are not but what all were "
    "when we there can your which their said if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called just where most know "
    "river bridge market letter garden engine winter summer morning evening question answer number story "
    "history science music paper window station village mountain island harbour forest kitchen doctor teacher "
    "price report budget review schedule meeting customer order invoice delivery recipe travel weather map"
).split()


def build_model(name: str, root: Path, weights: bool = True) -> Path:
    """The model's directory; weights False: its config.json and tokenizer alone (for --load-format dummy)."""
    path = root / (name if weights else f"{name}-config-only")
    if (path / "config.json").exists():
        return path
    import transformers as tf

    from tests.tiny_models import save_tokenizer

    cls, shape = MODELS[name]
    config = getattr(tf, cls)(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if not weights:
        config.save_pretrained(path)
        save_tokenizer(path)
        return path
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(path)
    del model
    empty_cache()
    return path


def block_fp8_checkpoint(model_dir: Path) -> Path:
    """A sibling of model_dir in HF's 128x128-block FP8 form: each layer's linear weight in e4m3 with its
    weight_scale_inv grid, embeddings, norms and LM head as they are (quantized on the GPU, shard by shard)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from batchgen.kernels.e4m3 import quantize_weight_ref
    from tests.fp8_checkpoints import quantization_config

    path = model_dir.parent / f"{model_dir.name}-fp8-block"
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, path / file.name)
    for file in sorted(model_dir.glob("*.safetensors")):
        out = {}
        with safe_open(file, framework="pt", device=DEVICE) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name.startswith("model.layers.") and name.endswith("proj.weight"):
                    out[name], out[name + "_scale_inv"] = quantize_weight_ref(tensor, block=True)
                else:
                    out[name] = tensor
        save_file({k: v.contiguous().cpu() for k, v in out.items()}, path / file.name, metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():  # every shard's scales sit beside their weights
        weight_map = json.loads(index.read_text())["weight_map"]
        weight_map.update({k + "_scale_inv": v for k, v in list(weight_map.items())
                           if k.startswith("model.layers.") and k.endswith("proj.weight")})
        (path / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config("block")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    empty_cache()
    return path


def with_chat_tokenizer(model_dir: Path) -> Path:
    """A sibling directory of model_dir with its weights (linked) and SmolLM2's tokenizer and chat template."""
    path = model_dir.with_name(model_dir.name + "-chat")
    path.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if not (path / f.name).exists() and not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (path / f.name).symlink_to(f.resolve())
    for f in CHAT_TOKENIZER.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, path / f.name)
    return path


def make_requests(workload: str, vocab: int) -> list[dict]:
    n, (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[workload]
    rng = random.Random(0)
    if workload == "W-chat":
        return [
            {"id": i, "messages": [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                                   {"role": "user", "content": user_turn(rng, rng.randint(in_lo, in_hi))}],
             "max_tokens": rng.randint(out_lo, out_hi)}
            for i in range(n)
        ]
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


def user_turn(rng: random.Random, words: int) -> str:
    """Sentences of 4 to 16 random words."""
    out = []
    while words > 0:
        k = min(words, rng.randint(4, 16))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + rng.choice(".?!"))
        words -= k
    return " ".join(out)


def as_token_ids(requests: list[dict], model_dir: Path) -> list[dict]:
    """Chat rows -> the same rows as the token ids the engine makes of them (chat template, then tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # as RequestPreparer tokenizes messages: the template's text, no special tokens added (it writes its own)
    ids = tok([chat_text(r["messages"], tok) for r in requests], add_special_tokens=False).input_ids
    return [{"id": r["id"], "prompt_token_ids": i, "max_tokens": r["max_tokens"]} for r, i in zip(requests, ids)]


class HostPauses:
    """Within the block: Python's garbage-collector time and the CUDA allocator's retries (a
    retry frees every cached block and synchronizes the device), to explain a slow run."""

    def __enter__(self):
        self.gc_s, self._start = 0.0, None
        gc.callbacks.append(self._on_gc)
        self._retries = self._alloc_retries()
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)
        self.alloc_retries = self._alloc_retries() - self._retries

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.gc_s += time.perf_counter() - self._start

    @staticmethod
    def _alloc_retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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


def run_batchgen(model_dir: Path, variants: dict[str, list[dict]], temperature: float, tp: int = 1,
                 repeats: int = 1, warm_up: bool = True, **options) -> dict[str, dict]:
    """Each variant's rows through one engine, the variants alternating, repeats times -> per variant,
    its best run (other work on the host only ever slows a run down), with every run's tok/s and the
    engine's start-up time. Every run starts from an empty prefix cache."""
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=tp, **{**ENGINE_OPTIONS, **options})
    startup = time.perf_counter() - start  # weights, KV pool, kernel warm-up, CUDA graph captures
    params = SamplingParams(temperature=temperature, ignore_eos=True)
    if warm_up:  # a first small job; --no-warm-up measures a user's first job right after start-up
        for requests in variants.values():
            llm.generate_list([{**r, "n": 1} for r in requests[:2]], params)
    synchronize()
    runs = {name: [] for name in variants}
    for _ in range(repeats):
        for name, requests in variants.items():
            if llm.engine.scheduler.cache is not None:
                llm.engine.scheduler.cache.clear()
            structured = llm.engine.structured
            structured.mask_seconds, structured.accept_seconds, structured.mask_steps = 0.0, 0.0, 0
            with GpuBusy() as busy, HostPauses() as pauses:
                start = time.perf_counter()
                results = llm.generate_list(requests, params)
                wall = time.perf_counter() - start
            tokens = sum(r["completion_tokens"] for r in results)
            want = sum(r["max_tokens"] * r.get("n", 1) for r in requests)
            constrained = any("response_format" in r for r in requests)  # (a grammar may end a row early)
            assert tokens == want or constrained, [r["error"] for r in results if r["error"]][:3]
            assert all(r["error"] is None for r in results), [r["error"] for r in results if r["error"]][:3]
            ttft = sorted(r["ttft_s"] for r in results)
            prompt_tokens = sum(r["prompt_tokens"] for r in results)
            hit_rate = sum(r["cached_prompt_tokens"] for r in results) / prompt_tokens if prompt_tokens else 0.0
            runs[name].append({"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
                               "ttft_p50_s": ttft[len(ttft) // 2], "gpu_busy_pct": busy.percent,
                               "startup_s": startup, "prefix_cache_hit_rate": round(hit_rate, 4),
                               "kv_cache_tokens": llm.engine.kv.num_slots,
                               "gc_s": round(pauses.gc_s, 3), "alloc_retries": pauses.alloc_retries,
                               "completion_tokens": [r["completion_tokens"] for r in results]})
            if structured.mask_steps:
                runs[name][-1]["mask_ms_per_step"] = 1000 * structured.mask_seconds / structured.mask_steps
                runs[name][-1]["accept_ms_per_step"] = 1000 * structured.accept_seconds / structured.mask_steps
    del llm
    gc.collect()  # the engine's CUDA graphs hold a cycle: free its memory before the next engine sizes its own
    empty_cache()
    best = {name: max(r, key=lambda run: run["tok_s"]) for name, r in runs.items()}
    for name, r in runs.items():
        best[name]["runs_tok_s"] = [round(run["tok_s"], 1) for run in r]
        best[name]["runs_gc_s"] = [run["gc_s"] for run in r]
        best[name]["runs_alloc_retries"] = [run["alloc_retries"] for run in r]
    return best


class NodeBusy:
    """Samples NVML's utilization of every GPU in a thread while the block runs (a replica's GPUs)."""

    def __enter__(self):
        import threading

        self.samples, self._stop = {}, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            return self
        self.samples = {i: [] for i in range(len(handles))}

        def sample():
            while not self._stop.wait(0.05):
                for i, h in enumerate(handles):
                    self.samples[i].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)

        threading.Thread(target=sample, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def percent(self, gpus: list[int]) -> float | None:
        values = [v for g in gpus for v in self.samples.get(g, [])]
        return round(sum(values) / len(values), 1) if values else None


def process_startup(model_dir: Path, tp: int) -> float:
    """Seconds from a fresh Python process's start to one engine ready, imports included (as a replica,
    or `batchgen run`, pays them)."""
    import subprocess

    code = (f"from batchgen import LLM; LLM({str(model_dir)!r}, dtype='bfloat16', tensor_parallel_size={tp}, "
            f"**{ENGINE_OPTIONS!r})")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    return time.perf_counter() - start


def run_node(model_dir: Path, requests: list[dict], temperature: float, dp: int, tp: int = 1,
             repeats: int = 1) -> dict:
    """W-node: the rows through dp replicas of tp GPUs each -> the best run's tok/s, start-up, each
    replica's rows, tok/s and GPU busy, and the imbalance at the end (first to last replica idle)."""
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE_OPTIONS)
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=temperature, ignore_eos=True)
    llm.generate_list(requests[: 2 * dp], params)  # every replica's first small job
    runs = []
    for _ in range(repeats):
        with NodeBusy() as busy:
            start = time.perf_counter()
            results = llm.generate_list(requests, params)
            wall = time.perf_counter() - start
        assert all(r["error"] is None for r in results), [r["error"] for r in results if r["error"]][:3]
        tokens = sum(r["completion_tokens"] for r in results)
        replicas = llm.stats.get("replicas") or [{"replica": 0, "rows": len(results), "output_tokens": tokens,
                                                  "generation_seconds": llm.stats["generation_seconds"],
                                                  "idle_after_s": llm.stats["generation_seconds"]}]
        idle = [r["idle_after_s"] for r in replicas if r.get("idle_after_s") is not None]
        runs.append({"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens, "startup_s": startup,
                     "imbalance_s": round(max(idle) - min(idle), 3) if idle else None,
                     "replicas": [{**r, "tok_s": round(r["output_tokens"] / r["generation_seconds"], 1)
                                   if r.get("generation_seconds") else None,
                                   "gpu_busy_pct": busy.percent(list(range(r["replica"] * tp,
                                                                           (r["replica"] + 1) * tp)))}
                                  for r in replicas]})
    llm.close()
    del llm
    gc.collect()
    empty_cache()
    best = max(runs, key=lambda run: run["tok_s"])
    best["runs_tok_s"] = [round(run["tok_s"], 1) for run in runs]
    return best


def hf_model(model_dir: Path):
    """HF transformers' model of model_dir in bf16 on DEVICE (--load-format dummy: HF's own random
    initialization from the config alone)."""
    import transformers as tf

    if ENGINE_OPTIONS["load_format"] == "dummy":  # initialized where it runs: a 30B model's 61 GB never on the host
        with torch.device(DEVICE):
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return model.to(DEVICE).eval()


def run_hf(model_dir: Path, requests: list[dict], batch_size: int = 64) -> dict:
    model = hf_model(model_dir)
    tokens = 0
    synchronize()
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
            model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0)
        tokens += sum(r["max_tokens"] for r in chunk)
    synchronize()
    wall = time.perf_counter() - start
    del model
    empty_cache()
    return {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens}


def run_hf_continuous(model_dir: Path, requests: list[dict], warm_up_requests: int = 4) -> dict:
    """HF transformers' continuous batching (the manager generate_batch() runs, with its attention: a paged
    or varlen form of the model's sdpa, or flash attention where installed) on requests: greedy, each
    request its own max_tokens, EOS off, so each generates exactly its max_tokens; the tokens are counted
    from the results. Timed from the first request submitted to the last result, after generate_batch()'s
    warm-up (CUDA graph captures) and a few requests through the same manager."""
    import transformers as tf
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = hf_model(model_dir)
    longest = max(r["max_tokens"] for r in requests)
    # eos_token_id -1: no token ends a request (the manager's own "disabled")
    config = tf.GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in requests),
                          max_generated_length=longest, num_requests=len(requests))  # as generate_batch() gives
    # generate_batch()'s defaults on a GPU; on a CPU a small KV pool (the default takes most of the free memory,
    # and zeroing it takes ~10 s)
    sizes = {} if DEVICE == "cuda" else {"num_blocks": 64, "max_batch_tokens": 1024}
    manager = model.init_continuous_batching(generation_config=config, workload_hints=hints,
                                             continuous_batching_config=tf.ContinuousBatchingConfig(**sizes))
    attention = model.config._attn_implementation  # the manager's switch, undone by stop()
    if DEVICE == "cuda":  # generate_batch()'s CUDA graph captures; on a CPU it only costs time
        manager.warmup()
    manager.start()
    try:
        hf_continuous_results(manager, requests[:warm_up_requests], "warm-up")
        synchronize()
        start = time.perf_counter()
        results = hf_continuous_results(manager, requests, "request")
        synchronize()
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()
    del manager, model
    gc.collect()
    empty_cache()
    tokens = sum(len(r.generated_tokens) for r in results)
    return {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens, "requests": len(results),
            "attention": attention}


def hf_continuous_results(manager, requests: list[dict], prefix: str) -> list:
    """Submits requests to a started continuous batching manager -> their finished results, in order."""
    ids = [f"{prefix}-{i}" for i in range(len(requests))]
    for request_id, r in zip(ids, requests):
        manager.add_request(r["prompt_token_ids"], request_id=request_id, max_new_tokens=r["max_tokens"],
                            eos_token_id=-1)
    done = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"HF continuous batching stopped with {len(ids) - len(done)} requests unfinished")
            continue
        if result.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
        if result.is_finished():
            done[result.request_id] = result
    return [done[i] for i in ids]


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
    ap.add_argument("--hf-continuous", type=int, default=0, metavar="N",
                    help="run HF transformers' continuous batching (generate_batch's manager) on the first N requests")
    ap.add_argument("--requests", type=int, help="only the first N requests of each workload (smoke checks)")
    ap.add_argument("--repeats", type=int, help="runs of each variant, best counts (default: 2 for W-chat, else 1)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=2,
                    help="W-node: the replicas measured against one (each --tensor-parallel-size GPUs)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--models-dir", default="/tmp/batchgen-bench-models")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="time the first job right after start-up (with a fresh TRITON_CACHE_DIR: a first run)")
    ap.add_argument("--compare-cache-off", action="store_true",
                    help="also run each workload with the prefix cache off (always done for W-prefix)")
    ap.add_argument("--compare-kv-fp8", action="store_true",
                    help="also run each workload with an fp8 KV cache (--kv-cache-dtype fp8)")
    ap.add_argument("--compare-fp8", nargs="*", choices=FP8_VARIANTS, metavar="VARIANT",
                    help="add --quantization fp8 (fp8), it with an fp8 KV pool (fp8_kv), and the 128-block "
                         "checkpoint form (block): those named, or all three")
    ap.add_argument("--compare-batch-invariant", action="store_true",
                    help="also run each workload with --batch-invariant (its cost, on the same rows)")
    ap.add_argument("--json-out", help="append the JSON lines to this file (benchmarks/results/DEVICE-DATE.jsonl)")
    ap.add_argument("--plot", help="write a PNG bar chart of this run's lines")
    ap.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                    help="dummy: write only each model's config.json and tokenizer; batchgen makes random weights")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="MoE models under -tp N: each GPU holds 1/N of the experts whole "
                         "(EngineConfig.expert_parallel)")
    args = ap.parse_args(argv)
    ENGINE_OPTIONS["load_format"] = args.load_format
    if args.expert_parallel:
        ENGINE_OPTIONS["expert_parallel"] = True
    lines = []
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for name in args.model:
        model_dir = build_model(name, Path(args.models_dir), weights=args.load_format != "dummy")
        for workload in args.workload:
            requests = make_requests(workload, MODELS[name][1]["vocab_size"])[: args.requests]
            line = {"workload": workload, "model": name, "gpu": gpu, "tp": args.tensor_parallel_size,
                    **({"load_format": "dummy"} if args.load_format == "dummy" else {}),
                    **({"expert_parallel": True} if args.expert_parallel else {}),
                    "torch": torch.__version__, "requests": len(requests), "temperature": args.temperature}
            if workload == "W-node":
                one = run_node(model_dir, requests, args.temperature, 1, args.tensor_parallel_size,
                               args.repeats or 1)
                many = run_node(model_dir, requests, args.temperature, args.data_parallel_size,
                                args.tensor_parallel_size, args.repeats or 1)
                one_process = process_startup(model_dir, args.tensor_parallel_size)
                line.update({"dp1_process_startup_s": round(one_process, 2),
                             "startup_ratio_vs_process": round(many["startup_s"] / one_process, 3)})
                line.update({"dp": args.data_parallel_size, "batchgen_tok_s": round(many["tok_s"], 1),
                             "runs_tok_s": many["runs_tok_s"], "dp1_tok_s": round(one["tok_s"], 1),
                             "dp1_runs_tok_s": one["runs_tok_s"],
                             "ratio_vs_dp1": round(many["tok_s"] / one["tok_s"], 3),
                             "startup_s": round(many["startup_s"], 2), "dp1_startup_s": round(one["startup_s"], 2),
                             "startup_ratio": round(many["startup_s"] / one["startup_s"], 3),
                             "imbalance_s": many["imbalance_s"], "replicas": many["replicas"],
                             "dp1_gpu_busy_pct": one["replicas"][0]["gpu_busy_pct"]})
                print(json.dumps(line), flush=True)
                lines.append(line)
                if args.json_out:
                    with open(args.json_out, "a") as f:
                        f.write(json.dumps(line) + "\n")
                continue
            if workload == "W-chat":
                chat_dir = with_chat_tokenizer(model_dir)
                ids = as_token_ids(requests, chat_dir)
                both = run_batchgen(chat_dir, {"token_ids": ids, "messages": requests}, args.temperature,
                                    args.tensor_parallel_size, args.repeats or 2, args.warm_up)
                ours, by_ids = both["messages"], both["token_ids"]
                line.update({"prompt_tokens": sum(len(r["prompt_token_ids"]) for r in ids),
                             "token_ids_tok_s": round(by_ids["tok_s"], 1),
                             "token_ids_wall_s": round(by_ids["wall_s"], 2),
                             "messages_vs_token_ids": round(ours["tok_s"] / by_ids["tok_s"], 3)})
                requests = ids  # what HF generate() gets, and the variants below
                same_rows, variant_dir = by_ids, chat_dir  # what the variants are compared with
            else:
                ours = run_batchgen(model_dir, {workload: requests}, args.temperature, args.tensor_parallel_size,
                                    args.repeats or 1, args.warm_up)[workload]
                same_rows, variant_dir = ours, model_dir
            line.update({"batchgen_tok_s": round(ours["tok_s"], 1), "batchgen_wall_s": round(ours["wall_s"], 2),
                         "batchgen_ttft_p50_s": round(ours["ttft_p50_s"], 3), "gpu_busy_pct": ours["gpu_busy_pct"],
                         "runs_tok_s": ours["runs_tok_s"], "runs_gc_s": ours["runs_gc_s"],
                         "runs_alloc_retries": ours["runs_alloc_retries"], "startup_s": round(ours["startup_s"], 2),
                         "warm_up_job": args.warm_up, "prefix_cache_hit_rate": ours["prefix_cache_hit_rate"]})
            repeats = args.repeats or 1

            def other(variant: list[dict], **options) -> dict:
                return run_batchgen(variant_dir, {workload: variant}, args.temperature, args.tensor_parallel_size,
                                    repeats, args.warm_up, **options)[workload]

            if workload == "W-prefix" or args.compare_cache_off:
                off = other(requests, enable_prefix_caching=False)
                line.update({"cache_off_tok_s": round(off["tok_s"], 1), "cache_off_wall_s": round(off["wall_s"], 2),
                             "cache_off_runs_tok_s": off["runs_tok_s"],
                             "ratio_vs_cache_off": round(same_rows["tok_s"] / off["tok_s"], 3)})
            if args.compare_kv_fp8:
                fp8 = other(requests, kv_cache_dtype="fp8")
                line.update({"kv_fp8_tok_s": round(fp8["tok_s"], 1), "kv_fp8_runs_tok_s": fp8["runs_tok_s"],
                             "kv_cache_tokens": same_rows["kv_cache_tokens"],
                             "kv_fp8_kv_cache_tokens": fp8["kv_cache_tokens"],
                             "ratio_kv_fp8_vs_auto": round(fp8["tok_s"] / same_rows["tok_s"], 3)})
            fp8_variants = [] if args.compare_fp8 is None else args.compare_fp8 or FP8_VARIANTS
            for label, variant_options in (("fp8", {"quantization": "fp8"}),
                                           ("fp8_kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
                if label in fp8_variants:
                    run = other(requests, **variant_options)
                    line.update({f"{label}_tok_s": round(run["tok_s"], 1), f"{label}_runs_tok_s": run["runs_tok_s"],
                                 f"{label}_kv_cache_tokens": run["kv_cache_tokens"],
                                 f"ratio_{label}_vs_bf16": round(run["tok_s"] / same_rows["tok_s"], 3)})
            if "block" in fp8_variants:
                block = run_batchgen(block_fp8_checkpoint(variant_dir), {workload: requests}, args.temperature,
                                     args.tensor_parallel_size, repeats, args.warm_up)[workload]
                line.update({"fp8_block_tok_s": round(block["tok_s"], 1), "fp8_block_runs_tok_s": block["runs_tok_s"],
                             "ratio_fp8_block_vs_bf16": round(block["tok_s"] / same_rows["tok_s"], 3),
                             "kv_cache_tokens": same_rows["kv_cache_tokens"]})
            if args.compare_batch_invariant:
                inv = other(requests, batch_invariant=True)
                line.update({"batch_invariant_tok_s": round(inv["tok_s"], 1),
                             "batch_invariant_runs_tok_s": inv["runs_tok_s"],
                             "ratio_batch_invariant": round(inv["tok_s"] / same_rows["tok_s"], 3)})
                if workload == "W-decode1":
                    line["batch_invariant_ms_per_token"] = round(1000 / inv["tok_s"], 3)
            if workload == "W-n":
                # the same job as n separate rows a prompt: without the cache (each row prefills its prompt)
                # and with it (the rows share the prompt through the cache, as n's samples do)
                rows = other(as_separate_rows(requests), enable_prefix_caching=False)
                cached = other(as_separate_rows(requests))
                line.update({"samples": SAMPLES, "separate_rows_tok_s": round(rows["tok_s"], 1),
                             "separate_rows_wall_s": round(rows["wall_s"], 2),
                             "ratio_vs_separate_rows": round(ours["tok_s"] / rows["tok_s"], 3),
                             "separate_rows_cache_on_tok_s": round(cached["tok_s"], 1),
                             "ratio_vs_separate_rows_cache_on": round(ours["tok_s"] / cached["tok_s"], 3)})
            if workload == "W-decode1":
                line["ms_per_token"] = round(1000 / ours["tok_s"], 3)
            if workload == "W-json":  # the same rows and output lengths, unconstrained
                free = [{"id": r["id"], "prompt_token_ids": r["prompt_token_ids"], "max_tokens": n}
                        for r, n in zip(requests, ours["completion_tokens"])]
                base = other(free)
                line.update({"mask_ms_per_step": round(ours.get("mask_ms_per_step", 0.0), 3),
                             "accept_ms_per_step": round(ours.get("accept_ms_per_step", 0.0), 3),
                             "ended_by_grammar": sum(n < r["max_tokens"]
                                                     for r, n in zip(requests, ours["completion_tokens"])),
                             "unconstrained_tok_s": round(base["tok_s"], 1),
                             "unconstrained_runs_tok_s": base["runs_tok_s"],
                             "json_ratio": round(ours["tok_s"] / base["tok_s"], 3)})
            if args.hf_continuous:
                hf = run_hf_continuous(model_dir, as_separate_rows(requests)[: args.hf_continuous])
                line.update({"hf_continuous_requests": hf["requests"],
                             "hf_continuous_tok_s": round(hf["tok_s"], 1),
                             "hf_continuous_wall_s": round(hf["wall_s"], 2),
                             "hf_continuous_attention": hf["attention"],
                             "ratio_vs_hf_continuous": round(ours["tok_s"] / hf["tok_s"], 2)})
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
