"""Start-up work on a GPU that would otherwise land inside a job's timing: Triton compiles a kernel
the first time it meets each specialization (integer arguments are specialized on being 1 or a
multiple of 16, pointers on 16-byte alignment), and the first job on a fresh machine paid seconds of
compilation per kernel. Here every kernel the engine launches eagerly runs once on synthetic steps,
before the CUDA graphs are captured (the captures' own warm-up forwards compile what the graphs
hold). The synthetic steps' arrays are aligned and a job's are views at any offset: the kernels do
not specialize those (kernels/__init__.py)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import triton

from batchgen.executor.kv_cache import KVCache
from batchgen.executor.sampling import SamplingBatch, sample
from batchgen.kernels.decode_attention import dense_tile_batch_sizes
from batchgen.kernels.device import num_sms
from batchgen.kernels.gumbel_argmax import gumbel_max
from batchgen.kernels.token_bitmask import apply_token_bitmask
from batchgen.layers.forward_batch import ForwardBatch

log = logging.getLogger("batchgen")


def triton_cache_dir() -> Path:
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton before 3.4
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def synthetic_batch(kv: KVCache, device: torch.device, decode_lens: list[int],
                    chunks: list[tuple[int, int]]) -> ForwardBatch:
    """A step of decodes (their context lengths) then prefill chunks ((new tokens, context length)),
    on rows 0.. of kv's token table and its first slots; its values are meaningless, its shapes real."""
    q_lens = [1] * len(decode_lens) + [q for q, _ in chunks]
    kv_lens = list(decode_lens) + [n for _, n in chunks]
    num_tokens, nd = sum(q_lens), len(decode_lens)
    cu_q = [0]
    for q in q_lens:
        cu_q.append(cu_q[-1] + q)
    positions = [n - q + j for q, n in zip(q_lens, kv_lens) for j in range(q)]
    rows = [i % kv.pad_row for i in range(len(q_lens))]
    logits = [end - 1 for end in cu_q[1:]]  # every sequence samples

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    def i64(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=i64(positions),
        out_slots=torch.arange(num_tokens, device=device) % kv.num_slots,
        token_rows=i32([r for r, q in zip(rows, q_lens) for _ in range(q)]),
        req_to_token=kv.req_to_token,
        num_decode=nd,
        decode_rows=i32(rows[:nd]),
        decode_kv_lens=i32(kv_lens[:nd]),
        decode_max_kv_len=max(kv_lens[:nd], default=0),
        prefill_rows=i32(rows[nd:]),
        prefill_q_start=i32([c - nd for c in cu_q[nd:-1]]),
        prefill_q_lens=i32(q_lens[nd:]),
        prefill_kv_lens=i32(kv_lens[nd:]),
        prefill_max_q_len=max(q_lens[nd:], default=0),
        logits_indices=i64(logits),
        seq_rows=i32(rows),
        q_start=i32(cu_q),
        kv_lens=i32(kv_lens),
    )


def reset_synthetic_rows(kv: KVCache) -> None:
    """Clear the token table entries synthetic batches wrote (all but the padding row's reserved slot)."""
    kv.req_to_token.zero_()
    kv.req_to_token[kv.pad_row, 0] = kv.pad_slot


def warm_plain_sampling(logits: torch.Tensor) -> None:
    """The sampler's paths for a step that only samples its logits (model_runner.ModelRunner.logits_dtype):
    Gumbel-max, its tokens into a kept buffer as with CUDA graphs or not, and greedy."""
    num_rows, dev = logits.shape[0], dict(device=logits.device)
    gumbel = SamplingBatch(
        temperatures=torch.full((num_rows,), 0.7, **dev), top_ks=None, top_ps=None,
        seeds=torch.arange(num_rows, **dev), steps=torch.zeros(num_rows, dtype=torch.int64, **dev),
        all_greedy=False, use_top_k_top_p=False,
    )
    sample(logits, gumbel, keep=torch.empty(num_rows, dtype=torch.int64, **dev))  # (a step graph's)
    sample(logits, gumbel)  # (an eager step's: the kernel that draws the token reads the logits too)
    sample(logits, SamplingBatch(None, None, None, None, None, True, False))


def warm_sampling(logits: torch.Tensor) -> None:
    """The sampler on every path a step can take (greedy, Gumbel-max, top-k/top-p) over logits
    [S, V]: compiles its kernels, and shows its peak memory to a profile."""
    num_rows, dev = logits.shape[0], dict(device=logits.device)
    warm_plain_sampling(logits)
    sample(logits, SamplingBatch(  # (the tokens not into a kept buffer)
        temperatures=torch.full((num_rows,), 0.7, **dev), top_ks=torch.full((num_rows,), 50, **dev),
        top_ps=torch.full((num_rows,), 0.9, **dev), seeds=torch.arange(num_rows, **dev),
        steps=torch.zeros(num_rows, dtype=torch.int64, **dev), all_greedy=False, use_top_k_top_p=True,
        min_ps=torch.full((num_rows,), 0.05, **dev),
    ))
    gumbel_max(logits, torch.full((num_rows,), 0.7, **dev), torch.arange(num_rows, **dev),
               torch.zeros(num_rows, dtype=torch.int64, **dev), 0)  # (a shard's: executor/sampling.py)
    # constrained rows' mask (every token allowed: the logits stay as they are)
    allow_all = torch.full((1, triton.cdiv(logits.shape[1], 32)), -1, dtype=torch.int32, **dev)
    apply_token_bitmask(logits, allow_all, torch.zeros(1, dtype=torch.int64, **dev))


def warm_up(runner) -> None:
    """Run every eager kernel specialization once (runner: a ModelRunner on CUDA with its KV pool)."""
    cache = triton_cache_dir()
    fresh = not cache.exists() or not any(cache.iterdir())
    log.info("compiling kernels (first run on this machine)..." if fresh else "warming up kernels...")
    start = time.perf_counter()
    kv, dev = runner.kv, runner.device
    # token counts 1, 2 (odd), 17 (odd), 64 (a multiple of 16); decode-only, prefill-only and mixed;
    # decode contexts of one block of keys (one split: written straight out) and of several (merged), for
    # one sequence (in index order) and for several (longest first: kernels/longest_first.py)
    long = min(160, kv.req_to_token.shape[1])
    steps = [([5], []), ([long], []), ([5, 9], []), ([long, 9], []), ([], [(17, 17)]), ([7, 3], [(15, 40)]),
             ([8] * 16, [(48, 48)])]
    # decode attention's tiles for many programs (kernels/decode_attention.pick_tile), where a job can have them
    for dense in dense_tile_batch_sizes(kv.k.shape[2], num_sms(dev), kv.k.dtype, kv.k.shape[3]):
        if dense <= runner.max_num_seqs:
            steps.append(([5] * dense, []))
    # a step that only samples its logits has them in the model's dtype (model_runner.ModelRunner.logits_dtype)
    narrow = runner.logits_dtype([], []) != torch.float32
    with torch.inference_mode():
        for decode_lens, chunks in steps:
            fb = synthetic_batch(kv, dev, decode_lens, chunks)
            fb.record_slots()
            logits = runner.forward(fb)
            warm_sampling(logits)
            if narrow:
                warm_plain_sampling(logits.to(runner.dtype))
        # the LM head at every number of sampled rows: cuBLAS picks a kernel by shape, and a kernel's
        # first launch loads its module (CUDA lazy loading), which a first job would otherwise pay
        hidden = torch.zeros((runner.max_num_seqs, runner.model_cfg.hidden_size), dtype=runner.dtype, device=dev)
        for rows in range(1, hidden.shape[0] + 1):
            runner.model.compute_logits(hidden[:rows])
            if narrow:
                runner.model.compute_logits(hidden[:rows], fp32=False)
            if runner.tp.size > 1:  # and its shard alone (executor/sampling.py)
                runner.model.lm_head.shard_logits(hidden[:rows])
        reset_synthetic_rows(kv)
    torch.cuda.synchronize(dev)
    log.info("kernels ready in %.1fs", time.perf_counter() - start)
