"""CUDA graphs of the model's forward, so that a step costs one replay instead of hundreds of kernel
launches from Python. Two ladders, all graphs sharing one memory pool:

- decode graphs, one per batch size (1, 2, 4, 8, 16, 32, ..., max_num_seqs), for decode-only steps:
  the split-KV decode attention kernel, which spreads long contexts over the GPU. A decode graph
  starts from the step's packed inputs (executor/step_inputs.py), which the host copies to a static
  buffer in one copy: its first kernel (kernels/unpack_decode.py) writes the static inputs, the
  pending tokens from the step in flight (`last_tokens`) and the token table;
- step graphs, one per padded token count (64, 128, ..., max_num_batched_tokens), for steps that
  carry prefill chunks (mixed or prefill-only): one unified attention launch per layer serves the
  decode and prefill queries alike from device-side metadata (docs/STEP.md).

A graph holds the model from the embedding to the final norm at the logits rows; the LM head runs
after the replay on exactly the rows that sample (its width would make padded rows costly, and its
output would otherwise have to live in the pool once per graph). A step of n tokens (or sequences)
replays the smallest graph of at least n: padding tokens write their K/V to the pool's reserved
slot, padding sequences have no queries and read the reserved row. Steps above the largest size,
and steps that score prompt tokens, run eagerly.
"""
from __future__ import annotations

import torch

from batchgen.executor.kv_cache import KVCache
from batchgen.executor.step_inputs import FIELDS, HEADER, SCALARS
from batchgen.kernels.longest_first import is_ordered, longest_first
from batchgen.kernels.unpack_decode import unpack_decode
from batchgen.layers.forward_batch import ForwardBatch

# From this many rows a decode step's products are bound by compute, not by reading the weights
# (llama-3.2-1b on an H200: ~166 rows), so the rows a graph pads a batch with cost time: the ladder
# takes steps of 8 rows from here (cuBLAS's tiles are multiples of 8 rows), 16 below.
FINE_LADDER_FROM = 128


def batch_size_ladder(max_bs: int) -> list[int]:
    """The decode graphs' batch sizes: 1, 2, 4, 8, then every 16 rows, every 8 from FINE_LADDER_FROM,
    and max_bs."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_bs] + list(range(16, min(max_bs, FINE_LADDER_FROM), 16))
    sizes += list(range(FINE_LADDER_FROM, max_bs, 8))
    return sizes + [max_bs]


def token_count_ladder(max_tokens: int) -> list[int]:
    """64-token steps up to 512, 128 up to 2048, 512 beyond: padding stays under ~25% of a step."""
    sizes = list(range(64, min(512, max_tokens) + 1, 64))
    sizes += list(range(640, min(2048, max_tokens) + 1, 128))
    sizes += list(range(2560, max_tokens + 1, 512))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


class ModelGraphs:
    def __init__(self, model, kv: KVCache, max_num_seqs: int, max_tokens: int, device: torch.device):
        """model(ForwardBatch) -> hidden states [S, H] of the batch's logits rows; kv: the pool the
        graphs read and write; max_tokens: the step token budget (the largest step graph). A graph
        that is not captured runs the same padded static batch eagerly."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.decode_sizes = batch_size_ladder(max_num_seqs)
        self.step_sizes = token_count_ladder(max_tokens)
        max_t = max([self.decode_sizes[-1], *self.step_sizes])
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # Static inputs: the graphs read these addresses; each replay refills them.
        self.input_ids = torch.zeros(max_t, **i64)
        self.positions = torch.zeros(max_t, **i64)
        self.out_slots = torch.full((max_t,), kv.pad_slot, **i64)
        self.logits_indices = torch.zeros(max_t, **i64)
        self.decode_logits = torch.arange(max_num_seqs, **i64)  # a decode step samples every token
        # per sequence (decode graphs: per token), padded to max_num_seqs
        self.seq_rows = torch.full((max_num_seqs,), kv.pad_row, **i32)
        self.kv_lens = torch.ones(max_num_seqs, **i32)
        self.q_start = torch.zeros(max_num_seqs + 1, **i32)
        self.decode_q_start = torch.arange(max_num_seqs + 1, **i32)  # a decode graph's: one query a sequence
        # decode graphs of 2 or more: the sequences longest context first (made in the graph)
        self.decode_schedule = torch.zeros(3 * max_num_seqs, **i32)
        # decode graphs: a decode-only step's packed inputs (at most len(FIELDS) + 1 values a sequence;
        # zeros read as an empty step), and the tokens of the step in flight
        self.packed = torch.zeros(HEADER + len(FIELDS) * (max_num_seqs + 1), **i64)
        self.last_tokens = torch.zeros(max_num_seqs, **i64)
        self.device, self.model = device, model
        self.batches = {(kind, n): self._static_batch(kind, n)
                        for kind, sizes in (("step", self.step_sizes), ("decode", self.decode_sizes)) for n in sizes}
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _capture(self) -> None:
        pool = None
        for key in sorted(self.batches, key=lambda k: -k[1]):  # largest first: the rest reuse its memory
            self._forward(key)  # warm-up outside the capture: compiles kernels, creates library handles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(key)
            pool = graph.pool()
            self.graphs[key] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def _forward(self, key: tuple[str, int]) -> torch.Tensor:
        """What a graph holds: for a decode graph, the unpacking of the packed inputs first."""
        fb = self.batches[key]
        if key[0] == "decode":
            unpack_decode(self.packed, self.last_tokens, fb.input_ids, fb.positions, fb.out_slots, fb.decode_rows,
                          fb.decode_kv_lens, self.kv.req_to_token, self.kv.pad_slot, self.kv.pad_row, len(SCALARS),
                          FIELDS)
            if fb.decode_schedule is not None:  # once for every layer's attention
                longest_first(fb.decode_kv_lens, fb.decode_rows, out=fb.decode_schedule)
        return self.model(fb)

    def _static_batch(self, kind: str, n: int) -> ForwardBatch:
        """The batch a graph of this kind and size is captured on: views of the static buffers."""
        req_to_token = self.kv.req_to_token
        width = req_to_token.shape[1]
        empty32 = self.seq_rows[:0]
        common = dict(input_ids=self.input_ids[:n], positions=self.positions[:n], out_slots=self.out_slots[:n],
                      req_to_token=req_to_token)
        if kind == "decode":
            rows, lens = self.seq_rows[:n], self.kv_lens[:n]
            return ForwardBatch(
                **common, token_rows=rows, num_decode=n, decode_rows=rows, decode_kv_lens=lens,
                decode_max_kv_len=width,  # any length: the kernel reads kv_lens
                decode_schedule=self.decode_schedule[: 3 * n].view(3, n) if is_ordered(n, rows.device) else None,
                prefill_rows=empty32, prefill_q_start=empty32, prefill_q_lens=empty32, prefill_kv_lens=empty32,
                prefill_max_q_len=0, logits_indices=self.decode_logits[:n],
                seq_rows=rows, q_start=self.decode_q_start[: n + 1], kv_lens=lens,  # (the unified view)
            )
        num_logits = min(n, self.max_num_seqs)
        return ForwardBatch(
            **common, token_rows=empty32, num_decode=0, decode_rows=empty32, decode_kv_lens=empty32,
            decode_max_kv_len=0, prefill_rows=empty32, prefill_q_start=empty32, prefill_q_lens=empty32,
            prefill_kv_lens=empty32, prefill_max_q_len=0, logits_indices=self.logits_indices[:num_logits],
            unified=True, seq_rows=self.seq_rows, q_start=self.q_start, kv_lens=self.kv_lens,
        )

    def decode_key(self, num_decode: int) -> tuple[str, int] | None:
        """The decode graph of a decode-only step of num_decode sequences, or None (eager)."""
        size = next((s for s in self.decode_sizes if s >= num_decode), None)
        return ("decode", size) if self.batches and size is not None and num_decode > 0 else None

    def run_decode(self, key: tuple[str, int], num_decode: int) -> torch.Tensor:
        """Replay the decode graph `key` on the step whose packed inputs are in self.packed -> hidden
        states [num_decode, H] (a view of the graph's output, valid until the next replay)."""
        if key not in self.graphs:  # not captured: the same padded batch, eagerly
            return self._forward(key)[:num_decode]
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:num_decode]

    def pick(self, fb: ForwardBatch, num_logits: int) -> tuple[str, int] | None:
        """The step graph that runs this batch (one with prefill chunks), or None (eager)."""
        if not self.batches or fb.num_prefill == 0:
            return None
        num_tokens = fb.input_ids.shape[0]
        size = next((s for s in self.step_sizes if s >= num_tokens), None)
        if size is None or num_logits > min(size, self.max_num_seqs) or fb.num_seqs > self.max_num_seqs:
            return None
        return ("step", size)

    def run(self, fb: ForwardBatch, key: tuple[str, int]) -> torch.Tensor:
        """Replay the step graph `key` (from pick) on fb -> hidden states [S, H] of fb's logits rows (a
        view of the graph's output, valid until the next replay)."""
        size = key[1]
        n = fb.input_ids.shape[0]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_slots[:n].copy_(fb.out_slots)
        num_logits = fb.logits_indices.shape[0]
        if size > n:  # padding tokens: position 0, K/V to the reserved slot
            self.positions[n:size].zero_()
            self.out_slots[n:size].fill_(self.kv.pad_slot)
        b = fb.num_seqs  # padding sequences: no queries (q_start stays at n), no context
        self.logits_indices[:num_logits].copy_(fb.logits_indices)
        self.seq_rows[:b].copy_(fb.seq_rows)
        self.kv_lens[:b].copy_(fb.kv_lens)
        self.q_start[: b + 1].copy_(fb.q_start)
        self.seq_rows[b:].fill_(self.kv.pad_row)
        self.kv_lens[b:].zero_()
        self.q_start[b + 1 :].fill_(n)
        self.logits_indices[num_logits : min(size, self.max_num_seqs)].zero_()
        if key not in self.graphs:  # not captured: the same padded batch, eagerly
            return self.model(self.batches[key])[:num_logits]
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:num_logits]

    def release(self, wait: bool = True) -> None:
        """Free the graphs now (wait: after the device finishes their work). Under tensor
        parallelism this must come before the NCCL communicator is torn down: NCCL keeps every
        communicator that a live graph captured, and its abort/destroy waits for those graphs."""
        if wait and self.graphs:
            torch.cuda.synchronize(self.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.batches.clear()
