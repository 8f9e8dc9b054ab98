"""How many replicas, on which GPUs, and what the dealer knows of a row before it is tokenized: its
prefix's digest and its estimated work."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from batchgen.config import EngineConfig
from batchgen.executor.memory import resolve_device

PREFIX_CHARS = 256  # the start of a prompt that decides which replica gets it


def data_parallel_size(config: EngineConfig) -> int:
    """config.data_parallel_size as a number: "auto" is every visible GPU over the tensor-parallel size
    (1 without a GPU)."""
    size = config.data_parallel_size
    if size != "auto":
        return int(size)
    if resolve_device(config.device).type != "cuda":
        return 1
    return max(1, torch.cuda.device_count() // config.tensor_parallel_size)


def replica_environments(config: EngineConfig, size: int) -> list[dict]:
    """Each replica's CUDA_VISIBLE_DEVICES: its own tensor_parallel_size GPUs of those visible."""
    if resolve_device(config.device).type != "cuda":
        return [{} for _ in range(size)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    tp = config.tensor_parallel_size
    if size * tp > len(gpus):
        raise ValueError(f"invalid --data-parallel-size: {size} replicas x {tp} GPUs each need {size * tp} GPUs, "
                         f"{len(gpus)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(size)]


def prefix_key(row) -> bytes | None:
    """What a row's prompt starts with, as a short digest: rows with the same key likely share a prefix."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        start = row["prompt"][:PREFIX_CHARS]
    elif isinstance(row.get("messages"), list) and row["messages"]:
        messages = row["messages"]
        start = json.dumps(messages[:-1] if len(messages) > 1 else messages, default=str)[:PREFIX_CHARS]
    elif isinstance(row.get("prompt_token_ids"), list):
        start = repr(row["prompt_token_ids"][:64])
    else:
        return None
    return hashlib.blake2b(start.encode(errors="replace"), digest_size=8).digest()


def estimated_tokens(row: dict, default_max_tokens: int, samples: int) -> int:
    """A row's tokens before it is tokenized: its prompt (token ids, or ~4 characters a token) and
    max_tokens for each sample."""
    if isinstance(row.get("prompt_token_ids"), list):
        prompt = len(row["prompt_token_ids"])
    elif isinstance(row.get("prompt"), str):
        prompt = len(row["prompt"]) // 4
    else:
        prompt = len(json.dumps(row.get("messages"), default=str)) // 4
    max_tokens = row.get("max_tokens")
    max_tokens = max_tokens if isinstance(max_tokens, int) and 0 < max_tokens < 2**31 else default_max_tokens
    return prompt + max_tokens * max(samples, 1)
