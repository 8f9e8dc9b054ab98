"""A token id -> its own text, for the `token` of top_logprobs (the engine's results) and of OpenAI
logprobs (io/openai_output.py): special tokens spelled out, each id decoded once (a job spells the
same few thousand ids millions of times, ~2 us a decode)."""
from __future__ import annotations

import functools
from collections.abc import Callable

TokenText = Callable[[int], str]


def token_text_of(tokenizer) -> TokenText:
    return functools.cache(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
