"""Run in a fresh process by test_warmup_gpu.py: an engine starts (warm-up, graph captures), then jobs
of many shapes run while Triton's jit_cache_hook records every kernel it compiles or loads from its
disk cache, that is every specialization the warm-up missed. Prints them as a JSON list.

    python -m tests.gpu.jobs_after_warmup MODEL_DIR {graphs|eager}
"""
import json
import random
import sys

from batchgen import LLM, SamplingParams
from tests.tiny_models import VOCAB


def jobs():
    rng = random.Random(0)

    def rows(count, lo=3, hi=300, out=(2, 40), **fields):
        return [{"prompt_token_ids": [rng.randrange(VOCAB - 1) for _ in range(rng.randint(lo, hi))],
                 "max_tokens": rng.randint(*out), **fields} for _ in range(count)]

    sampled = SamplingParams(temperature=0.8, ignore_eos=True)
    regex = {"structured_outputs": {"regex": "[a-z]{2,3}( [0-9a-z]{2,3}){2,6}"}}
    return [
        (rows(7), SamplingParams(temperature=0, ignore_eos=True)),
        (rows(13), sampled),  # odd row counts: the samplers' seeds are views at odd offsets
        (rows(1), sampled),
        (rows(5), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True)),
        (rows(9, logprobs=True, top_logprobs=3), sampled),
        (rows(3, prompt_logprobs=True), SamplingParams(temperature=0, ignore_eos=True)),  # eager steps
        (rows(5), SamplingParams(temperature=0.9, n=3, ignore_eos=True)),
        (rows(6), SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[5, 7])),
        (rows(61, 20, 120, (8, 48)), sampled),
        ([{"prompt": "the quick brown fox"[: 4 + i], **regex} for i in range(7)], SamplingParams(max_tokens=24)),
    ]


def main(model_dir: str, mode: str) -> None:
    from triton import knobs

    llm = LLM(model_dir, dtype="bfloat16", device="cuda", cuda_graphs=mode == "graphs", max_num_seqs=32,
              gpu_memory_utilization=0.3)
    compiled = []
    # (a hook that returns True would skip the launch)
    knobs.runtime.jit_cache_hook = lambda *args, **kw: compiled.append(" ".join(str(kw.get("key")).split())) or False
    errors = []
    for requests, params in jobs():
        errors += [r["error"] for r in llm.generate_list(requests, params) if r["error"]]
    print(json.dumps({"compiled": compiled, "errors": errors}))


if __name__ == "__main__":
    main(*sys.argv[1:])
