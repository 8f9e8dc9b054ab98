"""A request's life in the engine: validation of the input row, then the Sequence state the scheduler
and runner work on."""
from __future__ import annotations

import time
from array import array
from enum import Enum

from batchgen.sampling_params import SamplingParams, derive_seed, sample_seed
from batchgen.schema import (
    KNOWN_FIELDS, LOGPROB_OPTIONS, OUTPUT_OPTIONS, SAMPLING_FIELDS, STRUCTURED_FIELDS, FieldError, check_options,
    check_prompt, check_structured,
)


class RequestError(FieldError):
    """A bad request: its one-line message becomes the row's `error`."""


def prompt_token_ids(prompt: dict, tokenizer, vocab_size: int) -> list[int]:
    """prompt: check_prompt's {field: value} -> the prompt's token ids."""
    (field, value), = prompt.items()
    if field == "prompt":
        ids = tokenizer(value).input_ids
    elif field == "messages":
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("messages given but the model's tokenizer has no chat template; use prompt")
        text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = value
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
        self.logits_row = -1  # row of this sequence's token in the last launched step's samples
        self.num_prompt_scored = 0  # prompt positions already scored for prompt_logprobs
        self.row = -1
        self.slots = array("q")  # KV slots of positions 0..num_computed-1
        # Prefix cache: slots[:num_cached] belong to the cache (the path to cache_node, which this
        # sequence locks); the rest are its own. cached_prompt_tokens: prompt tokens it reused.
        self.num_cached = 0
        self.cache_node = None
        self.num_in_table = 0  # positions whose slots its token table row has (or gets in a built step)
        self.cached_prompt_tokens = 0
        self.sample_index = 0  # which of its row's n samples
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
        # top_logprobs: k, and per generated token its k most likely (token id, logprob)
        self.num_top_logprobs = 0
        self.top_logprobs: list[list[tuple[int, float]]] | None = None
        # constrained decoding (engine/structured.py): the row's spec, its compiled grammar (a
        # future, compiled on a worker thread) and the matcher that has accepted its output tokens
        self.structured = None
        self.grammar = None
        self.matcher = None
        self.error: str | None = None  # set when the sequence failed in the engine (its grammar)

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
    def reuse_limit(self) -> int:
        """How many leading tokens may come from the prefix cache: prompt tokens only, and at least
        one token left to compute for the logits; none of the prompt positions still to be scored
        for prompt_logprobs (their logits are needed)."""
        limit = min(self.num_prompt, self.num_tokens - 1)
        return limit if self.prompt_logprobs is None else min(limit, self.num_prompt_scored)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt + self.params.max_tokens


def make_sequence(row: dict, defaults: SamplingParams, job_seed: int, tokenizer, vocab_size: int,
                  eos_ids: list[int], max_len: int) -> Sequence:
    """Validate a request row and build its Sequence; raises RequestError with a one-line reason."""
    if not isinstance(row, dict):
        raise RequestError(f"a request must be an object, got {type(row).__name__}")
    try:
        options, prompt = check_options(row), check_prompt(row)
        params = defaults.replace(**{k: v for k, v in options.items() if k in SAMPLING_FIELDS})
    except ValueError as e:  # a FieldError, or a value SamplingParams refuses
        raise RequestError(str(e)) from None
    if params.seed is None and not params.greedy:
        params = params.replace(seed=derive_seed(job_seed, row.get("id")))
    ids = prompt_token_ids(prompt, tokenizer, vocab_size)
    if len(ids) + params.max_tokens > max_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the limit of {max_len} "
            "tokens (max model length or KV pool); shorten the prompt or lower max_tokens"
        )
    extras = {k: v for k, v in row.items() if k not in KNOWN_FIELDS}
    seq = Sequence(row.get("id"), ids, params, eos_ids, extras, time.monotonic())
    for name in LOGPROB_OPTIONS:
        if options.get(name):
            setattr(seq, name, [])
    if options.get("top_logprobs") is not None:
        seq.num_top_logprobs = options["top_logprobs"]
        seq.top_logprobs = []
    own = any(row.get(f) is not None for f in STRUCTURED_FIELDS)
    seq.structured = check_structured(row) if own else params.structured
    return seq


def make_samples(seq: Sequence, indices: list[int] | None = None) -> list[Sequence]:
    """The sequences of a request's n samples (seq: the request, as sample 0) -> those of `indices`
    (default: all n). Each sample has its own seed, derived from the request's and its index
    (sample 0 keeps the request's: n=1 is unchanged); the scheduler shares their prompt's KV
    through the prefix cache."""
    n = seq.params.n
    samples = []
    for i in range(n) if indices is None else sorted({i for i in indices if 0 <= i < n}):
        sample = seq
        if i > 0:
            params = seq.params.replace(seed=sample_seed(seq.params.seed, i))
            prompt = seq.token_ids[: seq.num_prompt]
            sample = Sequence(seq.id, prompt, params, list(seq.stop_ids), seq.extras, seq.arrival)
            for name in OUTPUT_OPTIONS:
                if getattr(seq, name) is not None:
                    setattr(sample, name, [])
            sample.num_top_logprobs = seq.num_top_logprobs
            # the same constraint, its grammar compiled once; each sample gets its own matcher
            sample.structured, sample.grammar = seq.structured, seq.grammar
        sample.sample_index = i
        samples.append(sample)
    return samples
