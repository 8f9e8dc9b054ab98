"""The packer: the order in which newly read requests are offered to the scheduler.

An offline job knows its prompts and max_tokens up front. Requests that share a prompt prefix go
next to each other (so their prefills run close together); groups, and requests inside a group, go
longest first (prompt + max_tokens): long requests start early instead of trailing alone at the end
of the job, and the short ones fill the gaps they leave in the batch.
"""
from __future__ import annotations

from batchgen.engine.request import Sequence

PREFIX_TOKENS = 32  # prompts that agree on this many leading tokens form a group


def pack(seqs: list[Sequence]) -> list[Sequence]:
    groups: dict[tuple, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(tuple(seq.token_ids[:PREFIX_TOKENS]), []).append(seq)
    ordered = []
    for group in sorted(groups.values(), key=lambda g: -max(s.max_total_tokens for s in g)):
        ordered.extend(sorted(group, key=lambda s: -s.max_total_tokens))
    return ordered
