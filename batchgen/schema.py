"""DESIGN.md's row contracts, shared by the engine, the file job and the queue: the fields of an
input row, and the output row of a request that failed."""
from __future__ import annotations

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")  # exactly one per row
SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
)
OUTPUT_OPTIONS = ("logprobs", "prompt_logprobs")  # opt-in: return log-probabilities
KNOWN_FIELDS = ("id", *PROMPT_FIELDS, *SAMPLING_FIELDS, *OUTPUT_OPTIONS)  # the rest is carried through
METRIC_FIELDS = ("queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "decode_tokens_per_s")


def error_result(row_id, message: str, extras: dict | None = None) -> dict:
    """The output row of a request that failed: no text, no tokens, no timings."""
    return {
        "id": row_id,
        **(extras or {}),
        "text": None,
        "output_token_ids": [],
        "finish_reason": "error",
        "error": message,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_prompt_tokens": 0,
        "num_preemptions": 0,
        **dict.fromkeys(METRIC_FIELDS),
    }
