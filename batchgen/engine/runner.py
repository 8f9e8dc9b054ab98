"""Model runner: owns the model and the KV pool on one device, turns a scheduled batch into a
ForwardBatch, runs the model and samples."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.config import EngineConfig
from batchgen.engine.cpu_memory import keep_freed_memory
from batchgen.engine.cuda_graphs import ModelGraphs
from batchgen.forward.batch import ForwardBatch
from batchgen.engine.kv_cache import KVCache
from batchgen.forward.parallel import SINGLE, TensorParallel
from batchgen.engine.product_tuning import tune_products
from batchgen.engine.request import Sequence
from batchgen.engine.scheduler import ScheduledBatch
from batchgen.engine.staging import Staging
from batchgen.engine.shard_sampling import sampling_parameters, samples_from_shards, tokens_from_shards
from batchgen.engine.step_inputs import HEADER, StepInputs
from batchgen.engine.warmup import synthetic_batch, warm_sampling, warm_up
from batchgen.kernels.longest_first import is_ordered, longest_first
from batchgen.kernels.token_bitmask import apply_token_bitmask
from batchgen.layers.sampler import SamplingBatch, sample
from batchgen.models.loader import build_model
from batchgen.models.model_config import ModelConfig

log = logging.getLogger("batchgen")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("invalid --device: cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":  # bf16 where the CPU multiplies it natively (about 2x fp32), else fp32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    # on a GPU, half precision: the checkpoint's own when it has one, bf16 for fp32 checkpoints
    return DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's, or fp8 e4m3 (kernels/store_kv.py says how values go in)."""
    if name == "auto":
        return model_dtype
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
    if (major, minor) < (8, 9):  # (the CPU converts in software)
        raise ValueError(
            f"invalid --kv-cache-dtype: {name} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}; use --kv-cache-dtype auto"
        )
    return torch.float8_e4m3fn


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, tp: TensorParallel = SINGLE):
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp.size > 1:  # one GPU per rank; the caller made it current
            self.device = torch.device("cuda", tp.rank)
        self.dtype = resolve_dtype(config.dtype, model_cfg.torch_dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if model_cfg.sliding_window:  # we attend to the whole context: stay inside the window
            self.max_model_len = min(self.max_model_len, model_cfg.sliding_window)
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(default_budget, config.max_num_seqs)
        self.model = build_model(model_cfg, model_dir, self.dtype, self.device, self.max_model_len, tp)
        if self.device.type == "cpu":
            keep_freed_memory()
            self.model.pack_weights()
        else:  # (before the KV pool is sized: it keeps a copy of each down projection)
            self.model.use_one_row_mlps(self.device, tp.size)
        attn = self.model.attention_layers()[0]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        # room for a step's index arrays: ~4 per token and ~8 per sequence
        self.staging = Staging(self.device, 8 * (self.max_num_batched_tokens + config.max_num_seqs))
        # every rank holds the same slots (its share of the heads): the pool is what the tightest rank fits
        self.kv = self._make_kv_cache(tp.min_over_ranks(self._num_kv_slots()))
        self.graphs = None
        self._kept_sampling: KeptSampling | None = None  # the last step's sampling parameters (sampling_batch)
        if self.device.type == "cuda":
            warm_up(self)  # before any job's timing: every kernel specialization an eager step uses
            tune_products(self)  # cuBLAS or a tile for each product of 65-256 rows (before graphs hold them)
            if config.cuda_graphs:
                with torch.inference_mode():
                    self.graphs = ModelGraphs(self.model, self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                              self.device)

    # ---- KV pool -------------------------------------------------------------------------------
    def _make_kv_cache(self, num_slots: int) -> KVCache:
        kv = KVCache(
            self.model_cfg.num_layers, num_slots, self.num_kv_heads, self.head_dim, self.config.max_num_seqs,
            self.max_model_len, self.kv_dtype, self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = kv.k[i], kv.v[i]
        return kv

    def _num_kv_slots(self) -> int:
        cfg = self.config
        useful = cfg.max_num_seqs * self.max_model_len  # more slots than this can never be used
        if cfg.kv_cache_tokens:
            return cfg.kv_cache_tokens
        per_token = KVCache.bytes_per_token(self.model_cfg.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        self._memory_note = ""
        if self.device.type == "cpu":
            budget = cfg.cpu_kv_cache_gb * 2**30
        else:
            peak = self._profile_peak_bytes()
            # CUDA graphs keep a memory pool of their own, as large as the largest graphed step
            peaks = 2 if cfg.cuda_graphs else 1
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_utilization - (total - free) - peaks * peak
            self._memory_note = (
                f": {total / 2**30:.1f} GiB x {cfg.gpu_memory_utilization} minus {(total - free) / 2**30:.1f} GiB "
                f"in use minus {peaks} x a {peak / 2**30:.1f} GiB activation peak"
            )
            log.info("KV cache budget %.1f GiB%s", budget / 2**30, self._memory_note)
        slots = min(int(budget // per_token), useful)
        if slots < self.max_model_len and slots < 16:
            raise ValueError(
                f"no memory left for the KV cache ({slots} token slots from a budget of {budget / 2**30:.1f} GiB"
                f"{self._memory_note}); raise --gpu-memory-utilization, lower --max-num-batched-tokens, "
                "or set --kv-cache-tokens"
            )
        return slots

    def _profile_peak_bytes(self) -> int:
        """Run the largest step (a full token budget, logits for max_num_seqs rows) on a scratch pool
        and measure the activation memory it needs beyond the weights."""
        seqs = self.config.max_num_seqs  # budget >= max_num_seqs: one row of logits per sequence
        tokens = min(self.max_num_batched_tokens, seqs * self.max_model_len)
        scratch = self._make_kv_cache(tokens)
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        lens = [n for n in lens if n > 0]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch = synthetic_batch(scratch, self.device, [], [(n, n) for n in lens])
        with torch.inference_mode():
            batch.record_slots()
            logits = self.forward(batch)  # one row per sequence: max_num_seqs rows
            warm_sampling(logits)  # every sampling path: the peak is top-k/top-p's sort
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, batch, logits
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        torch.cuda.empty_cache()
        return peak

    # ---- one step ------------------------------------------------------------------------------
    def _tensor(self, values, dtype) -> torch.Tensor:
        return self.staging.to_device([values], dtype)[0]

    def _stage(self, arrays: list, dtype: torch.dtype) -> list[torch.Tensor]:
        return self.staging.to_device(arrays, dtype)

    def step_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence], list]:
        """The host side of a step -> its StepInputs; the sequences that sample a token this step (in
        logits order); and the prompt tokens scored for prompt_logprobs as (sequence, count, target
        ids), whose logits follow the samplers' in logits_indices. Input tokens that the step in
        flight is sampling are listed in pending_dst/pending_src."""
        nd = batch.num_decode
        rows = [s.row for s in batch.seqs]
        # Decodes first (one token each, always sampled, never scoring a prompt token): a tight loop.
        input_ids, positions, token_rows = [], batch.starts[:nd], rows[:nd]
        logits_indices, samplers = list(range(nd)), batch.seqs[:nd]
        scored, score_indices = [], []
        pending_dst, pending_src = [], []  # input tokens still on the device: (batch index, sample row)
        for i, (seq, start) in enumerate(zip(samplers, positions)):
            token_ids = seq.token_ids
            if start < len(token_ids):
                input_ids.append(token_ids[start])
            else:  # sampled by the step in flight: taken from its output on the device
                pending_dst.append(i)
                pending_src.append(seq.logits_row)
                input_ids.append(0)
        # Prefill chunks: all their tokens are on the host (a token still in flight is always a
        # sequence's last, so its sequence is a decode, and admission waits for read-backs).
        for seq, start, n in zip(batch.seqs[nd:], batch.starts[nd:], batch.num_new[nd:]):
            first = len(input_ids)
            assert start + n <= len(seq.token_ids), "a prefill chunk reaches a token still in flight"
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            token_rows.extend([seq.row] * n)
            if start + n == seq.num_tokens:  # the chunk reaches the end: sample the next token
                logits_indices.append(first + n - 1)
                samplers.append(seq)
            if seq.prompt_logprobs is not None:
                # position p predicts prompt token p + 1; recomputation after preemption skips known ones
                lo, hi = max(start, seq.num_prompt_scored), min(start + n, seq.num_prompt - 1)
                if hi > lo:
                    score_indices.extend(range(first + lo - start, first + hi - start))
                    scored.append((seq, hi - lo, seq.token_ids[lo + 1 : hi + 1]))
                    seq.num_prompt_scored = hi
        logits_indices += score_indices
        kv_lens = [start + n for start, n in zip(batch.starts, batch.num_new)]
        cu_q = [0, *itertools.accumulate(batch.num_new)]
        q_start = [c - nd for c in cu_q[nd:-1]]
        inputs = StepInputs.pack(
            [nd, len(samplers), max(kv_lens[:nd], default=0), max(batch.num_new[nd:], default=0),
             int(samples_from_shards(self.tp.size, samplers, scored))],
            [input_ids, positions, batch.slots, logits_indices, pending_dst, pending_src,
             batch.prefix_rows, batch.prefix_positions, batch.prefix_slots,
             token_rows, rows, kv_lens, q_start, batch.num_new[nd:], cu_q],
        )
        return inputs, samplers, scored

    def forward_batch(self, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> ForwardBatch:
        """Stage a step's inputs on the device (one copy) -> its ForwardBatch. Pending input tokens
        are read from previous_tokens, the sampled tokens of the step in flight, on the device."""
        self.staging.next_step()
        packed = self.staging.to_device([inputs.packed], torch.int64)[0]
        a = inputs.split(packed[HEADER:])
        nd = inputs.num_decode
        fb = ForwardBatch(
            input_ids=a["input_ids"],
            positions=a["positions"],
            out_slots=a["out_slots"],
            token_rows=a["token_rows"],
            req_to_token=self.kv.req_to_token,
            num_decode=nd,
            decode_rows=a["rows"][:nd],
            decode_kv_lens=a["kv_lens"][:nd],
            decode_max_kv_len=inputs.decode_max_kv_len,
            prefill_rows=a["rows"][nd:],
            prefill_q_start=a["q_start"],
            prefill_q_lens=a["q_lens"],
            prefill_kv_lens=a["kv_lens"][nd:],
            prefill_max_q_len=inputs.prefill_max_q_len,
            logits_indices=a["logits_indices"],
            seq_rows=a["rows"],
            q_start=a["cu_q"],
            kv_lens=a["kv_lens"],
        )
        if inputs.has_pending:
            fb.input_ids[a["pending_dst"]] = previous_tokens[a["pending_src"]]
        if inputs.has_prefix_writes:  # sequences admitted with a cached prefix: their rows point at it
            fb.req_to_token[a["prefix_rows"], a["prefix_positions"]] = a["prefix_slots"].to(torch.int32)
        return fb

    def run_step(self, inputs: StepInputs, previous_tokens: torch.Tensor | None,
                 logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The model on one step (every rank) -> logits [num_logits, V] in logits_dtype (fp32, or the
        model's dtype: logits_dtype()). Steps that score no prompt tokens replay a CUDA graph
        (docs/STEP.md); the LM head runs after the replay, on exactly the rows that sample."""
        if self.graphs is not None and inputs.decode_only:
            key = self.graphs.decode_key(inputs.num_decode)
            if key is not None:  # one copy: the graph unpacks it, pending tokens from graphs.last_tokens
                self.staging.next_step()
                self.staging.to_static(inputs.packed, self.graphs.packed)
                if inputs.has_prefix_writes:  # (rare: decodes whose prompts the cache advanced this step)
                    a = inputs.split(self.graphs.packed[HEADER : HEADER + sum(inputs.sizes)])
                    self.kv.req_to_token[a["prefix_rows"], a["prefix_positions"]] = a["prefix_slots"].to(torch.int32)
                hidden = self.graphs.run_decode(key, inputs.num_decode)
                self.staging.static_read()  # (the graph's first kernel has unpacked graphs.packed)
                return self._logits(hidden, inputs, logits_dtype)
        fb = self.forward_batch(inputs, previous_tokens)
        fb.record_slots()  # (a step graph holds no table writes: their number varies from step to step)
        key = None
        if self.graphs is not None and inputs.num_logits == inputs.num_sampled:
            key = self.graphs.pick(fb, inputs.num_logits)
        if key is not None:
            hidden = self.graphs.run(fb, key)
        else:
            if is_ordered(fb.num_decode, fb.decode_kv_lens.device):  # once for every layer's decode attention
                fb.decode_schedule = longest_first(fb.decode_kv_lens, fb.decode_rows)
            hidden = self.model(fb)
        return self._logits(hidden, inputs, logits_dtype)

    def _logits(self, hidden: torch.Tensor, inputs: StepInputs, logits_dtype: torch.dtype) -> torch.Tensor:
        """The whole vocabulary's logits [S, V], or this rank's shard of them where the step samples
        from shards (engine/shard_sampling.py)."""
        if inputs.sample_from_shards:
            return self.model.lm_head.shard_logits(hidden)
        return self.model.compute_logits(hidden, fp32=logits_dtype == torch.float32)

    def logits_dtype(self, samplers: list[Sequence], scored: list) -> torch.dtype:
        """The dtype a step's logits are made in: the model's 16-bit dtype where they are only sampled,
        plainly (argmax or Gumbel-max: no log-probabilities, top-k/top-p, grammar mask or banned tokens),
        on one GPU. HF transformers and vLLM sample from logits in that dtype too, and the LM head
        writes half the bytes that the sampler reads back: 13-17 us less a step of 64-256 rows of a
        128k vocabulary on an H200 (KERNELS.md, session 27). Else fp32."""
        narrow = (self.dtype != torch.float32 and self.device.type == "cuda" and self.tp.size == 1
                  and not scored and all(seq.plain_sampling for seq in samplers))
        return self.dtype if narrow else torch.float32

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on a batch whose slots are in the token table -> logits [S, V] fp32."""
        return self.model.compute_logits(self.model(fb))

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The samplers' parameters on the device. When the same sequences sample as in the step before,
        each one token further, the device tensors of that step are kept and sampled at a step offset
        (an argument of the sampling kernel: no op on the device, where two staged copies were; a lone
        sequence's decode is bound by the ops between its steps)."""
        vocab = self.model_cfg.vocab_size
        params = [s.params for s in seqs]
        banned_rows, banned_ids = [], []
        for i, s in enumerate(seqs):
            if s.num_generated < s.params.min_tokens:
                banned_rows.extend([i] * len(s.stop_ids))
                banned_ids.extend(s.stop_ids)
        banned = self._stage([banned_rows, banned_ids], torch.int64) if banned_rows else (None, None)
        if all(p.greedy for p in params):  # argmax only: no per-row parameters needed
            return SamplingBatch(None, None, None, None, None, True, False, *banned)
        generated = [s.num_generated for s in seqs]
        kept = self._kept_sampling
        if not banned_rows and kept is not None and kept.follows(seqs, generated):
            kept.generated = generated
            return dataclasses.replace(kept.batch, step_offset=generated[0] - kept.staged[0])
        top_ks, seeds, steps = self._stage(
            [[p.top_k if p.top_k > 0 else vocab for p in params], [p.seed or 0 for p in params], generated],
            torch.int64,
        )
        temperatures, top_ps = self._stage([[p.temperature for p in params], [p.top_p for p in params]], torch.float32)
        batch = SamplingBatch(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, seeds=seeds, steps=steps, all_greedy=False,
            use_top_k_top_p=any(p.truncates for p in params),
            banned_rows=banned[0], banned_ids=banned[1],
        )
        self._kept_sampling = None if banned_rows else KeptSampling(list(seqs), generated, batch)
        return batch

    @torch.inference_mode()
    def launch_forward(self, inputs: StepInputs, previous: StepOutput | None,
                       logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rank 0: queue a step's forward -> its logits [num_logits, V] in logits_dtype (logits_dtype()),
        not waited for."""
        return self.run_step(inputs, previous.tokens if previous is not None else None, logits_dtype)

    @torch.inference_mode()
    def launch_sampling(self, logits: torch.Tensor, samplers: list[Sequence], scored: list,
                        mask: tuple[list[int], torch.Tensor] | None = None, from_shards: bool = False) -> StepOutput:
        """Rank 0: queue sampling of a launched step's logits, and the log-probabilities asked for.
        mask: (indices of constrained samplers, their token bitmask [C, W] int32 on the host), applied
        to those rows before sampling; log-probabilities are the model's, taken before it.
        from_shards: the step's inputs said so; logits are this rank's shard (engine/shard_sampling.py)."""
        num_sampled = len(samplers)
        outputs = []  # fp32 values read back: sampled tokens' logprobs, then prompt logprobs
        tokens = top = None
        wanting = []
        if samplers:
            lp_rows, lp = self._logprob_rows(logits, samplers)  # (before the mask changes the logits)
            wanting = [i for i in lp_rows if samplers[i].logprobs is not None]
            if wanting:
                wanted_lp = self._lp_of(lp_rows, lp, wanting)
            top = self._top_logprobs(lp_rows, lp, samplers)
            if mask is not None:
                rows, bitmask = mask
                self._apply_mask(logits, rows, bitmask)
            if from_shards:  # (nothing above applies: samples_from_shards)
                parameters = sampling_parameters(self.sampling_batch(samplers), num_sampled, self.device)
                tokens = tokens_from_shards(self.tp, logits, self.tp.broadcast(parameters), self.model.lm_head.start)
                self._keep_tokens(tokens)
            else:  # (the sampler keeps the tokens for the next decode graph itself)
                tokens = sample(logits[:num_sampled], self.sampling_batch(samplers), self._pending_tokens())
                self.tp.broadcast(tokens)  # the other ranks' next step may take input tokens from them
            if wanting:
                wanted_tokens = tokens if len(wanting) == len(samplers) else tokens[self._tensor(wanting, torch.int64)]
                outputs.append(wanted_lp.gather(1, wanted_tokens[:, None]).squeeze(1))
        if scored:
            targets = self._tensor([t for _, _, ids in scored for t in ids], torch.int64)
            lp = torch.log_softmax(logits[num_sampled:], dim=-1)
            outputs.append(lp.gather(1, targets[:, None]).squeeze(1))
        for i, seq in enumerate(samplers):
            seq.logits_row = i
            seq.num_pending += 1
        return StepOutput(samplers, wanting, [(seq, count) for seq, count, _ in scored], tokens,
                          torch.cat(outputs) if outputs else None, self.staging, top)

    def _logprob_rows(self, logits: torch.Tensor, samplers: list[Sequence]):
        """The log-softmax of the samplers that asked for logprobs or top_logprobs, taken once ->
        (their indices, [R, V] fp32 on the device), or ([], None)."""
        rows = [i for i, s in enumerate(samplers) if s.logprobs is not None or s.num_top_logprobs > 0]
        if not rows:
            return rows, None
        # every sampler asking (an OpenAI job with logprobs): no [S, V] gather
        picked = logits[: len(samplers)] if len(rows) == len(samplers) else logits[self._tensor(rows, torch.int64)]
        return rows, torch.log_softmax(picked, dim=-1)

    def _lp_of(self, lp_rows: list[int], lp: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The rows of lp (taken for the samplers lp_rows) of the samplers `indices`, a subsequence."""
        if len(indices) == len(lp_rows):
            return lp
        position = {row: j for j, row in enumerate(lp_rows)}
        return lp[self._tensor([position[i] for i in indices], torch.int64)]

    def _top_logprobs(self, lp_rows: list[int], lp: torch.Tensor | None, samplers: list[Sequence]):
        """-> (indices of samplers that asked for top_logprobs, their k, ids [T, k_max] int64,
        logprobs [T, k_max] fp32) on the device, or None when none asked."""
        asking = [i for i in lp_rows if samplers[i].num_top_logprobs > 0]
        if not asking:
            return None
        ks = [samplers[i].num_top_logprobs for i in asking]
        values, ids = self._lp_of(lp_rows, lp, asking).topk(max(ks), dim=-1)
        return asking, ks, ids, values

    def _apply_mask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """The constrained rows' token bitmask onto their logits, in place: one copy, one op."""
        if self.device.type == "cuda":
            bitmask = bitmask.to(self.device, non_blocking=True)
        apply_token_bitmask(logits, bitmask, self._tensor(rows, torch.int64))

    @torch.inference_mode()
    def follow(self, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """A rank other than 0: the same step's forward, then the sampled tokens [S] (rank 0's, broadcast
        on the device, or taken from every rank's shard), which the next step's pending input tokens
        are read from."""
        logits = self.run_step(inputs, previous_tokens)
        if inputs.num_sampled == 0:
            return None
        if inputs.sample_from_shards:
            parameters = self.tp.broadcast(torch.empty((3, inputs.num_sampled), dtype=torch.int64, device=self.device))
            tokens = tokens_from_shards(self.tp, logits, parameters, self.model.lm_head.start)
        else:
            tokens = self.tp.broadcast(torch.empty(inputs.num_sampled, dtype=torch.int64, device=self.device))
        self._keep_tokens(tokens)
        return tokens

    def _pending_tokens(self) -> torch.Tensor | None:
        """Where the next decode graph reads its pending input tokens (None: no graphs)."""
        return None if self.graphs is None else self.graphs.last_tokens

    def _keep_tokens(self, tokens: torch.Tensor) -> None:
        """A step's sampled tokens into _pending_tokens (where the sampler did not write them itself)."""
        if (pending := self._pending_tokens()) is not None:
            pending[: tokens.shape[0]].copy_(tokens)


class KeptSampling:
    """A step's sampling parameters on the device, and the sequences and token counts they were made for."""

    def __init__(self, seqs: list[Sequence], generated: list[int], batch: SamplingBatch):
        self.seqs, self.generated, self.batch = seqs, generated, batch
        self.staged = generated  # the counts batch.steps holds: a later step samples at an offset

    def follows(self, seqs: list[Sequence], generated: list[int]) -> bool:
        """Whether seqs are these sequences, in this order, each with one token more."""
        return (len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs))
                and all(g == h + 1 for g, h in zip(generated, self.generated)))


class StepOutput:
    """The results of a launched step, copied back to the host as the device produces them."""

    def __init__(self, samplers, wanting, scored, tokens, values, staging: Staging, top=None):
        self.samplers = samplers  # sequences that sampled, in the order of `tokens`
        self.wanting = wanting  # indices of samplers that asked for their token's logprob
        self.scored = scored  # (sequence, number of prompt logprobs), in the order of `values`
        self.tokens = tokens  # [S] int64 on the device, or None
        results = [t for t in (tokens, values) if t is not None]
        # top_logprobs: (sampler indices, their k, ids [T, k_max], logprobs [T, k_max]); all copied back at once
        hosts, self._event = staging.to_host(results + ([] if top is None else list(top[2:])))  # (event: None on CPU)
        self._host = hosts[: len(results)]
        self._top = None if top is None else (top[0], top[1], *hosts[len(results):])
        self.top_logprobs: list[tuple[int, list[tuple[int, float]]]] = []  # set by read()

    def read(self, check: Callable[[], None] | None = None) -> tuple[list[int], list[float], list[float]]:
        """Wait for the step -> (sampled tokens, their logprobs for `wanting`, prompt logprobs).
        check: called while waiting, to raise if another tensor-parallel rank died (its collectives
        would keep this step from ever finishing)."""
        if self._event is not None:
            if check is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    check()
                    time.sleep(1e-4)
        host = [t.tolist() for t in self._host]
        if self._top is not None:
            asking, ks, ids, values = self._top
            self.top_logprobs = [
                (i, list(zip(row_ids[:k], row_values[:k])))
                for i, k, row_ids, row_values in zip(asking, ks, ids.tolist(), values.tolist())
            ]
        tokens = host.pop(0) if self.tokens is not None else []
        values = host.pop(0) if host else []
        split = len(self.wanting)
        return tokens, values[:split], values[split:]
