"""A request's life in the engine: validation of the input row, then the Sequence state the scheduler
and runner work on."""
from __future__ import annotations

from array import array

import time
from enum import Enum

import torch

from batchgen.sampling_params import SamplingParams, derive_seed
from batchgen.schema import KNOWN_FIELDS, OUTPUT_OPTIONS, PROMPT_FIELDS, SAMPLING_FIELDS


class RequestError(ValueError):
    """A bad request: its one-line message becomes the row's `error`."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v, what: str) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
        raise RequestError(f"{what} must be a list of integers")
    return list(v)


def sampling_from_row(row: dict, defaults: SamplingParams) -> SamplingParams:
    """The job's defaults with the row's non-null overrides, type-checked."""
    changes = {}
    for name in SAMPLING_FIELDS:
        value = row.get(name)
        if value is None:
            continue
        if name in ("max_tokens", "min_tokens", "top_k", "seed"):
            if not _is_int(value):
                raise RequestError(f"{name} must be an integer, got {value!r}")
        elif name in ("temperature", "top_p"):
            if not (_is_int(value) or isinstance(value, float)):
                raise RequestError(f"{name} must be a number, got {value!r}")
            value = float(value)
        elif name == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
                raise RequestError("stop must be a string or a list of strings")
            value = list(value)
        elif name == "stop_token_ids":
            value = _int_list(value, "stop_token_ids")
        elif name == "ignore_eos" and not isinstance(value, bool):
            raise RequestError(f"ignore_eos must be true or false, got {value!r}")
        changes[name] = value
    try:
        return defaults.replace(**changes)
    except ValueError as e:
        raise RequestError(str(e)) from None


def prompt_token_ids(row: dict, tokenizer, vocab_size: int) -> list[int]:
    present = [f for f in PROMPT_FIELDS if row.get(f) is not None]
    if len(present) != 1:
        raise RequestError(
            "a row needs exactly one of prompt, messages, prompt_token_ids; "
            + (f"found {', '.join(present)}" if present else "found none")
        )
    field = present[0]
    value = row[field]
    if field == "prompt":
        if not isinstance(value, str):
            raise RequestError(f"prompt must be a string, got {type(value).__name__}")
        if not value.strip():
            raise RequestError("prompt is empty")
        ids = tokenizer(value).input_ids
    elif field == "messages":
        if not isinstance(value, (list, tuple)) or not value:
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(f"messages[{i}] must be an object with string role and content")
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("messages given but the model's tokenizer has no chat template; use prompt")
        text = tokenizer.apply_chat_template(list(value), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = _int_list(value, "prompt_token_ids")
        if not ids:
            raise RequestError("prompt_token_ids is empty")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise RequestError(f"{field} tokenizes to no tokens")
    return list(ids)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request in the engine. token_ids = prompt + generated tokens known on the host; behind
    them come num_pending tokens sampled by steps still in flight on the device (the engine runs
    one step ahead of reading results). The KV of the first num_computed tokens is in the pool at
    req_to_token[row, :num_computed]."""

    def __init__(self, request_id, prompt_ids: list[int], params: SamplingParams, eos_ids: list[int],
                 extras: dict, arrival: float):
        self.id = request_id
        self.extras = extras
        self.params = params
        self.num_prompt = len(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_pending = 0  # sampled on the device, not yet read back
        self.sample_index = -1  # row of this sequence's token in the last launched step's samples
        self.num_prompt_scored = 0  # prompt positions already scored for prompt_logprobs
        self.row = -1
        self.slots = array("q")  # KV slots of positions 0..num_computed-1
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.finished_at: float | None = None
        # log p(token) of each generated token / of each prompt token after the first, when asked for
        self.logprobs: list[float] | None = None
        self.prompt_logprobs: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens so far, pending ones included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, pending ones included."""
        return self.num_tokens - self.num_prompt

    @property
    def done_sampling(self) -> bool:
        """Its last token is sampled (possibly still pending): nothing left to schedule."""
        return self.num_generated >= self.params.max_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt + self.params.max_tokens


def make_sequence(row: dict, defaults: SamplingParams, job_seed: int, tokenizer, vocab_size: int,
                  eos_ids: list[int], max_len: int) -> Sequence:
    """Validate a request row and build its Sequence; raises RequestError with a one-line reason."""
    if not isinstance(row, dict):
        raise RequestError(f"a request must be an object, got {type(row).__name__}")
    params = sampling_from_row(row, defaults)
    if params.seed is None and not params.greedy:
        params = params.replace(seed=derive_seed(job_seed, row.get("id")))
    ids = prompt_token_ids(row, tokenizer, vocab_size)
    if len(ids) + params.max_tokens > max_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the limit of {max_len} "
            "tokens (max model length or KV pool); shorten the prompt or lower max_tokens"
        )
    extras = {k: v for k, v in row.items() if k not in KNOWN_FIELDS}
    seq = Sequence(row.get("id"), ids, params, eos_ids, extras, time.monotonic())
    for name in OUTPUT_OPTIONS:
        value = row.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false, got {value!r}")
        if value:
            setattr(seq, name, [])
    return seq
