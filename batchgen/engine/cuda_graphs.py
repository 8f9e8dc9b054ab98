"""CUDA graphs for decode-only steps: one graph per batch size of a ladder (1, 2, 4, 8, 16, 32, ...,
max_num_seqs), all sharing one memory pool. A decode batch of n sequences replays the smallest graph
of at least n, its extra entries padded to a reserved row and slot of the KV pool. Mixed (prefill)
steps run eagerly."""
from __future__ import annotations

import torch

from batchgen.forward.batch import ForwardBatch
from batchgen.engine.kv_cache import KVCache


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [n for n in (1, 2, 4, 8) if n < max_bs] + list(range(16, max_bs, 16))
    return sizes + [max_bs]


class DecodeGraphs:
    def __init__(self, forward, kv: KVCache, max_bs: int, device: torch.device):
        """forward(ForwardBatch) -> logits [n, V]; kv: the pool the graphs read and write."""
        self.kv = kv
        self.sizes = batch_size_ladder(max_bs)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # static inputs: the graphs read these addresses; each replay refills them
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_slots = torch.full((max_bs,), kv.pad_slot, **i64)
        self.rows = torch.full((max_bs,), kv.pad_row, **i32)
        self.kv_lens = torch.ones(max_bs, **i32)
        self.logits_indices = torch.arange(max_bs, **i64)
        empty32 = torch.zeros(0, **i32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            fb = ForwardBatch(
                input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_slots=self.out_slots[:bs],
                token_rows=self.rows[:bs], req_to_token=kv.req_to_token, num_decode=bs,
                decode_rows=self.rows[:bs], decode_kv_lens=self.kv_lens[:bs],
                decode_max_kv_len=kv.req_to_token.shape[1],  # any length: kernels read kv_lens
                prefill_rows=empty32, prefill_q_start=empty32, prefill_q_lens=empty32, prefill_kv_lens=empty32,
                prefill_max_q_len=0, logits_indices=self.logits_indices[:bs],
            )
            forward(fb)  # warm-up outside the capture: compiles kernels, creates library handles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(fb)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(device)

    def can_run(self, fb: ForwardBatch) -> bool:
        return bool(self.graphs) and fb.num_prefill == 0 and 0 < fb.num_decode <= self.sizes[-1]

    def release(self, wait: bool = True) -> None:
        """Free the graphs now (wait: after the device finishes their work). Under tensor
        parallelism this must come before the NCCL communicator is torn down: NCCL keeps every
        communicator that a live graph captured, and its abort/destroy waits for those graphs."""
        if wait and self.graphs:
            torch.cuda.synchronize(self.input_ids.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Replay for a decode-only batch -> logits [n, V] (a view of the graph's output)."""
        n = fb.num_decode
        bs = next(size for size in self.sizes if size >= n)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_slots[:n].copy_(fb.out_slots)
        self.rows[:n].copy_(fb.decode_rows)
        self.kv_lens[:n].copy_(fb.decode_kv_lens)
        if bs > n:  # padding entries: the reserved row and slot, a context of one token
            self.out_slots[n:bs].fill_(self.kv.pad_slot)
            self.rows[n:bs].fill_(self.kv.pad_row)
            self.kv_lens[n:bs].fill_(1)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]
