"""One step's host-side inputs packed into one int64 tensor: every tensor-parallel rank builds the
same ForwardBatch from it. Rank 0 builds it from the scheduled batch and, under tensor parallelism,
sends the same bytes to the other ranks.

Layout: [num_decode, num_sampled, decode_max_kv_len, prefill_max_q_len, sample_from_shards, size of
each array], then
the arrays in FIELDS order. The int32 arrays come last, so they form one tail that the device
converts at once.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

INT64_FIELDS = (
    "input_ids",  # [T], 0 where the token is still being sampled by the step in flight
    "positions",  # [T]
    "out_slots",  # [T]
    "logits_indices",  # [S + scored], the samplers' tokens, then the prompt tokens scored
    "pending_dst",  # [N], input_ids entries taken from the step in flight's sampled tokens...
    "pending_src",  # [N], ...at these rows of them
    "prefix_rows",  # [C], token-table writes of cached prefixes: req_to_token[prefix_rows, prefix_positions]...
    "prefix_positions",  # [C]
    "prefix_slots",  # [C], ... = prefix_slots
)
INT32_FIELDS = (
    "token_rows",  # [T]
    "rows",  # [B], decodes first
    "kv_lens",  # [B]
    "q_start",  # [P], prefill chunks only, relative to the first prefill token
    "q_lens",  # [P]
    "cu_q",  # [B + 1], every sequence: sequence i's tokens are [cu_q[i], cu_q[i + 1])
)
FIELDS = INT64_FIELDS + INT32_FIELDS
SCALARS = ("num_decode", "num_sampled", "decode_max_kv_len", "prefill_max_q_len", "sample_from_shards")
HEADER = len(SCALARS) + len(FIELDS)


@dataclass
class StepInputs:
    packed: torch.Tensor  # [HEADER + sum(sizes)] int64, on the host
    num_decode: int
    num_sampled: int  # sequences that sample a token: the first num_sampled logits rows
    decode_max_kv_len: int
    prefill_max_q_len: int
    sample_from_shards: int  # 1: each rank samples from its shard of the vocabulary (executor/sampling.py)
    sizes: list[int]  # per FIELDS entry

    @classmethod
    def pack(cls, scalars: list[int], arrays: list) -> StepInputs:
        """scalars in SCALARS order; arrays (sequences of ints) in FIELDS order. One C-level buffer
        and one tensor over it: a tensor per array cost more than the rest of the packing."""
        sizes = [len(a) for a in arrays]
        values = array("q", scalars)
        values.extend(sizes)
        for a in arrays:
            values.extend(a)
        return cls(torch.frombuffer(values, dtype=torch.int64), *scalars, sizes)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StepInputs:
        if packed.numel() < HEADER:
            raise ValueError(f"a step message of {packed.numel()} values is shorter than its header")
        header = packed[:HEADER].tolist()
        sizes = header[len(SCALARS) :]
        if min(sizes) < 0 or HEADER + sum(sizes) != packed.numel():
            raise ValueError(f"a step message of {packed.numel()} values does not match its header {header}")
        return cls(packed, *header[: len(SCALARS)], sizes)

    @property
    def num_logits(self) -> int:
        return self.sizes[FIELDS.index("logits_indices")]

    @property
    def has_pending(self) -> bool:
        return self.sizes[FIELDS.index("pending_dst")] > 0

    @property
    def decode_only(self) -> bool:
        """Every sequence decodes one token (no prefill chunk, no prompt scored)."""
        return self.sizes[FIELDS.index("rows")] == self.num_decode and self.num_logits == self.num_sampled

    @property
    def has_prefix_writes(self) -> bool:
        return self.sizes[FIELDS.index("prefix_rows")] > 0

    def split(self, body: torch.Tensor) -> dict[str, torch.Tensor]:
        """body: the packed values after the header (on any device) -> {field: int64 or int32 view}."""
        n64 = sum(self.sizes[: len(INT64_FIELDS)])
        parts = list(body[:n64].split(self.sizes[: len(INT64_FIELDS)]))
        parts += body[n64:].to(torch.int32).split(self.sizes[len(INT64_FIELDS) :])
        return dict(zip(FIELDS, parts))
