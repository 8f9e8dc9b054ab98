"""The model runner: builds the model and its KV tensors on one device, and runs a step's forward from
its StepInputs, by CUDA graph or eagerly (every tensor-parallel rank; ranks other than 0 follow rank 0's
steps and sampling)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from batchgen.config import EngineConfig
from batchgen.executor.cpu_memory import keep_freed_memory
from batchgen.executor.cpu_threads import CpuThreads, usable_cores
from batchgen.executor.cuda_graphs import ModelGraphs
from batchgen.executor.kv_cache import KVCache
from batchgen.executor.memory import (
    check_fits,
    num_kv_slots,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_max_num_seqs,
)
from batchgen.executor.product_tuning import tune_products
from batchgen.executor.sampling import Sampler
from batchgen.executor.staging import Staging
from batchgen.executor.step_inputs import HEADER, StepInputs
from batchgen.executor.warmup import warm_up
from batchgen.kernels.longest_first import is_ordered, longest_first
from batchgen.layers.forward_batch import ForwardBatch
from batchgen.models.loader import build_model
from batchgen.models.model_config import ModelConfig
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel

log = logging.getLogger("batchgen")


def cpu_threads_of(config: EngineConfig, tp_size: int) -> int | None:
    """The CPU threads of each rank: config.cpu_threads, or None (automatic) on one rank. Under tensor
    parallelism the ranks share the cores evenly (each would count the others as a foreign load)."""
    if config.cpu_threads is not None or tp_size == 1:
        return config.cpu_threads
    return max(1, usable_cores() // tp_size)


class ModelRunner:
    """One rank's model, KV tensors, step graphs and sampler."""

    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, tp: TensorParallel = SINGLE):
        self.config = config
        self.model_cfg = model_cfg
        if tp.size > 1 and config.expert_parallel:
            tp = dataclasses.replace(tp, expert_parallel=True)
        self.tp = tp
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp.size > 1:  # one GPU per rank; the caller made it current
            self.device = torch.device("cuda", tp.rank)
        self.dtype = resolve_dtype(config.dtype, model_cfg.torch_dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        context = model_cfg.context_length()
        if config.max_model_len and config.max_model_len > context:
            raise ValueError(f"invalid --max-model-len: {config.max_model_len} is past the model's context length "
                             f"({context}, from its config.json); give at most that")
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if model_cfg.sliding_window:  # we attend to the whole context: stay inside the window
            self.max_model_len = min(self.max_model_len, model_cfg.sliding_window)
        # (every rank the same: the ranks' graphs and steps must match)
        self.max_num_seqs = tp.min_over_ranks(
            resolve_max_num_seqs(config.max_num_seqs, config.max_num_batched_tokens, self.device,
                                 moe=model_cfg.num_experts > 0))
        # (its token table, [max_num_seqs, max_model_len] int32, before the model takes the memory)
        check_fits("max_num_seqs", self.max_num_seqs, f"sequences of up to {self.max_model_len} tokens",
                   4 * (self.max_num_seqs + 1) * self.max_model_len, self.device,
                   "give fewer, or a smaller --max-model-len")
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(default_budget, self.max_num_seqs)
        # the thread count first: loading converts and packs weights on these threads too
        self.cpu_threads = CpuThreads(cpu_threads_of(config, tp.size)) if self.device.type == "cpu" else None
        self.model = build_model(model_cfg, model_dir, self.dtype, self.device, self.max_model_len, tp,
                                 pdl=config.pdl, load_format=config.load_format, seed=config.seed,
                                 quantization=config.quantization)
        if config.batch_invariant:  # (refused for MoE and FP8 models, on every device)
            self.model.use_batch_invariant_kernels()
        self.model.agree_on_deferred_sums()
        if self.device.type == "cpu":
            keep_freed_memory()
            self.model.pack_weights()
        elif not config.batch_invariant:  # (before the KV pool is sized: it keeps a copy of each down projection)
            self.model.use_one_row_mlps(self.device, tp.size)
        attn = self.model.attention_layers()[0]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        # room for a step's index arrays: ~4 per token and ~8 per sequence
        self.staging = Staging(self.device, 8 * (self.max_num_batched_tokens + self.max_num_seqs))
        # every rank holds the same slots (its share of the heads): the pool is what the tightest rank fits
        self.kv = self.make_kv_cache(tp.min_over_ranks(num_kv_slots(self)))
        self.graphs = None
        self.sampler = Sampler(model_cfg.vocab_size, self.staging, tp, self.model.lm_head.start)
        if self.device.type == "cuda":
            warm_up(self)  # before any job's timing: every kernel specialization an eager step uses
            if not config.batch_invariant:  # (its products take one kernel at every row count)
                tune_products(self)  # cuBLAS or a tile for each product of 65-256 rows (before graphs hold them)
            if config.cuda_graphs:
                with torch.inference_mode():
                    self.use_graphs(ModelGraphs(self.model, self.kv, self.max_num_seqs,
                                                self.max_num_batched_tokens, self.device))

    def close(self) -> None:
        """Free what this runner holds on its device: the CUDA graphs, the KV pool, the model's weights and
        the staging buffers; on CUDA the allocator's cached blocks go back to the driver, so that another
        engine in this process can size its KV pool from them. Idempotent; no step runs afterwards."""
        if self.model is None:
            return
        if self.graphs is not None:
            self.graphs.release()  # (waits for the device to finish their work)
        self.kv.release()
        self.graphs = self.model = self.staging = self.sampler = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def use_graphs(self, graphs: ModelGraphs) -> None:
        """Run the steps that graphs hold through them; the sampler keeps every step's tokens where the
        decode graphs read their pending input tokens."""
        self.graphs = graphs
        self.sampler.kept_tokens = graphs.last_tokens

    def make_kv_cache(self, num_slots: int) -> KVCache:
        """A KV pool of num_slots token slots, its layers' views handed to the attention layers."""
        kv = KVCache(
            self.model_cfg.num_layers, num_slots, self.num_kv_heads, self.head_dim, self.max_num_seqs,
            self.max_model_len, self.kv_dtype, self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = kv.k[i], kv.v[i]
        return kv

    # ---- one step ------------------------------------------------------------------------------
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
        from shards (sampling.samples_from_shards)."""
        if inputs.sample_from_shards:
            return self.model.lm_head.shard_logits(hidden)
        return self.model.compute_logits(hidden, fp32=logits_dtype == torch.float32)

    def logits_dtype(self, samplers: list, scored: list) -> torch.dtype:
        """The dtype a step's logits are made in: the model's 16-bit dtype where they are only sampled,
        plainly (argmax or Gumbel-max: no log-probabilities, top-k/top-p, grammar mask or banned
        tokens), on one GPU, as HF transformers and vLLM sample (the LM head then writes half the
        bytes); else fp32."""
        narrow = (self.dtype != torch.float32 and self.device.type == "cuda" and self.tp.size == 1
                  and not self.config.batch_invariant  # (a row's logits dtype must not follow its step's others)
                  and not scored and all(seq.plain_sampling for seq in samplers))
        return self.dtype if narrow else torch.float32

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on a batch whose slots are in the token table -> logits [S, V] fp32."""
        return self.model.compute_logits(self.model(fb))

    @torch.inference_mode()
    def launch_forward(self, inputs: StepInputs, previous_tokens: torch.Tensor | None,
                       logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rank 0: queue a step's forward -> its logits [num_logits, V] in logits_dtype (logits_dtype()),
        not waited for. previous_tokens: the sampled tokens of the step in flight."""
        if self.cpu_threads is not None:
            self.cpu_threads.adjust()
        return self.run_step(inputs, previous_tokens, logits_dtype)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """A rank other than 0: the same step's forward, then its sampled tokens [S] (sampling's
        follow), which the next step's pending input tokens are read from."""
        logits = self.run_step(inputs, previous_tokens)
        if inputs.num_sampled == 0:
            return None
        return self.sampler.follow(logits, inputs.num_sampled, bool(inputs.sample_from_shards))
