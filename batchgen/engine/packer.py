"""The packer: the order in which newly read requests are offered to the scheduler.

An offline job knows its prompts and max_tokens up front. Requests that share a prompt prefix go
next to each other; groups, and requests inside a group, go longest first (prompt + max_tokens):
long requests start early instead of trailing alone at the end of the job, and the short ones fill
the gaps they leave in the batch.

This is the plan the prefix cache works to: the first request of a group computes the shared prefix
(the scheduler caches prompt tokens as it schedules them, and admits no one else before a running
prompt is fully scheduled), the rest of the group is admitted after it and reuses it, and once the
group's last request finishes nothing locks the prefix: it is the first to go when the pool needs
room (least recently used). The n samples of a request have one prompt: they stay adjacent (the sort
is stable), so the prompt is computed once for all of them.
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
