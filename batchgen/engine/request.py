"""A request's life in the engine: the input row checked and tokenized into a PreparedRequest (pure:
any thread may do it, batches of rows at a time), then the Sequence state the scheduler and runner
work on (built on the engine thread)."""
from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from array import array
from dataclasses import dataclass
from enum import Enum
from typing import Any

from jinja2 import TemplateError

from batchgen.sampling_params import SamplingParams, derive_seed, sample_seed
from batchgen.schema import (
    KNOWN_FIELDS,
    LOGPROB_OPTIONS,
    SAMPLING_FIELDS,
    STRUCTURED_FIELDS,
    FieldError,
    check_options_and_constraint,
    check_prompt,
)


class RequestError(FieldError):
    """A bad request: its one-line message becomes the row's `error`."""


@dataclass
class PreparedRequest:
    """A request row checked and tokenized, not yet in the engine."""

    id: Any
    prompt_ids: list[int]
    params: SamplingParams
    extras: dict  # the row's other columns, carried through to its result
    outputs: tuple[str, ...]  # the LOGPROB_OPTIONS the row asked for
    arrival: float  # time.monotonic() when it was ready for the engine
    top_logprobs: int | None = None  # k alternatives per generated token, when asked for
    structured: Any = None  # its decoding constraint (schema.StructuredSpec), its own or the job's
    bad_words_ids: list[list[int]] | None = None  # params.bad_words tokenized (bad_word_ids)


@dataclass
class _Checked:
    """A row whose fields passed the checks, on its way to the tokenizer."""

    options: dict
    params: SamplingParams
    structured: Any  # the row's own decoding constraint, else the job's (None: unconstrained)
    field: str  # its prompt field
    text: str | None  # to tokenize: the prompt, or the chat template's text of the messages
    ids: list[int] | None  # the prompt's ids: given, or once tokenized


@dataclass(frozen=True)
class RequestPreparer:
    """Rows -> a PreparedRequest or a RequestError each, in order. Reads only its own fields: safe to
    call from a worker thread while the engine runs. The rows' texts go to the tokenizer in one call
    per batch (a fast tokenizer encodes a batch in Rust, with the GIL released)."""

    defaults: SamplingParams
    job_seed: int
    tokenizer: Any
    vocab_size: int
    max_len: int  # prompt + max_tokens of one request: the model's length or the whole KV pool

    def __call__(self, rows: list) -> list[PreparedRequest | RequestError]:
        checked = [self._check(row) for row in rows]
        # A plain prompt gets the tokenizer's special tokens (BOS); a chat template writes its own.
        for field, special in (("prompt", True), ("messages", False)):
            todo = [i for i, c in enumerate(checked) if isinstance(c, _Checked) and c.field == field]
            if not todo:
                continue
            try:
                encoded = self.tokenizer([checked[i].text for i in todo], add_special_tokens=special).input_ids
            except Exception:  # one text the tokenizer refuses fails the whole call: charge it to its row alone
                encoded = [self._encode_one(checked[i], special) for i in todo]
            for i, ids in zip(todo, encoded):
                if isinstance(ids, RequestError):
                    checked[i] = ids
                else:
                    checked[i].ids = ids
        return [c if isinstance(c, RequestError) else self._finish(row, c) for row, c in zip(rows, checked)]

    def _encode_one(self, c: _Checked, special: bool) -> list[int] | RequestError:
        try:
            return self.tokenizer([c.text], add_special_tokens=special).input_ids[0]
        except Exception as e:
            return RequestError(f"{c.field} could not be tokenized: {_one_line(e)}")

    @property
    def max_chars(self) -> int:
        """The most characters a text may have and still fit in max_len tokens: no token stands for
        more characters than the vocabulary's longest. Longer texts are refused before they are
        tokenized (or templated), so a huge prompt costs no more than its own bytes."""
        return self.max_len * longest_token_chars(self.tokenizer)

    def _check_length(self, field: str, chars: int) -> None:
        limit = self.max_chars
        if chars > limit:
            raise RequestError(
                f"{field} is too long: {chars} characters cannot fit in the limit of {self.max_len} tokens (max "
                f"model length or KV pool), at most {limit // self.max_len} characters a token; shorten it"
            )

    def _check(self, row) -> _Checked | RequestError:
        if not isinstance(row, dict):
            return RequestError(f"a request must be an object, got {type(row).__name__}")
        try:
            (options, own), prompt = check_options_and_constraint(row), check_prompt(row)
            changes = {k: v for k, v in options.items() if k in SAMPLING_FIELDS}
            defaults = self.defaults
            if changes.get("seed", defaults.seed) is None and changes.get("temperature", defaults.temperature) != 0.0:
                changes["seed"] = derive_seed(self.job_seed, row.get("id"))  # sampled: a seed of its own
            if "min_tokens" not in changes and changes.get("max_tokens", defaults.max_tokens) < defaults.min_tokens:
                raise RequestError(f"max_tokens {changes['max_tokens']} is below the job's min_tokens "
                                   f"({defaults.min_tokens}, --min-tokens or its SamplingParams); give this row a "
                                   "min_tokens too, or a larger max_tokens")
            params = defaults.replace(**changes)
            # the row's own constraint (its {"type": "text"} too: None) wins over the job's
            structured = own if any(f in options for f in STRUCTURED_FIELDS) else params.structured
            for i, t in enumerate(params.stop_token_ids):  # the row's own, or the job's
                if not 0 <= t < self.vocab_size:
                    raise RequestError(f"stop_token_ids[{i}] is {t}, outside the vocabulary [0, {self.vocab_size})")
            for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
                bad = next((t for t in ids or () if not t < self.vocab_size), None)  # (the schema checked t >= 0)
                if bad is not None:
                    raise RequestError(f"{name} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
            (field, value), = prompt.items()
            if field == "prompt":
                self._check_length("prompt", len(value))
                return _Checked(options, params, structured, field, value, None)
            if field == "messages":  # (the template's own text comes on top: only the contents count here)
                self._check_length("messages", sum(len(m.get("content") or "") for m in value))
                return _Checked(options, params, structured, field, chat_text(value, self.tokenizer), None)
            if min(value) < 0 or max(value) >= self.vocab_size:
                bad = next(t for t in value if not 0 <= t < self.vocab_size)
                raise RequestError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})")
            return _Checked(options, params, structured, field, None, value)
        except ValueError as e:  # a FieldError, or a value SamplingParams refuses
            return RequestError(str(e))

    @functools.cached_property
    def _default_bad_word_ids(self) -> list[list[int]]:
        """The job's default bad words tokenized once, not for every row that keeps them."""
        return bad_word_ids(self.tokenizer, self.defaults.bad_words)

    def _finish(self, row: dict, c: _Checked) -> PreparedRequest | RequestError:
        if not c.ids:
            return RequestError(f"{c.field} tokenizes to no tokens")
        keep = c.params.truncate_prompt_tokens
        if keep is not None and len(c.ids) > keep:  # (vLLM's: the prompt's end is what the output follows)
            c.ids = c.ids[-keep:]
        if len(c.ids) + c.params.max_tokens > self.max_len:
            return RequestError(
                f"prompt ({len(c.ids)} tokens) + max_tokens ({c.params.max_tokens}) exceeds the limit of "
                f"{self.max_len} tokens (max model length or KV pool); shorten the prompt or lower max_tokens"
            )
        extras = {k: v for k, v in row.items() if k not in KNOWN_FIELDS}
        outputs = tuple(name for name in LOGPROB_OPTIONS if c.options.get(name))
        words = c.params.bad_words
        bad = None if not words else self._default_bad_word_ids if words == self.defaults.bad_words else (
            bad_word_ids(self.tokenizer, words))
        return PreparedRequest(row.get("id"), c.ids, c.params, extras, outputs, time.monotonic(),
                               c.options.get("top_logprobs"), c.structured, bad)


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, as vLLM takes them: the word as given (leading spaces stripped), and with
    one leading space where that gives another first token in as many tokens (the word inside a text)."""
    ids = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        ids.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return ids


def chat_text(messages: list[dict], tokenizer) -> str:
    """checked messages -> the prompt text of the model's chat template, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("messages given but the model's tokenizer has no chat template; use prompt")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template's own raise_exception(): roles out of order, and the like
        raise RequestError("messages refused by the model's chat template: " + _one_line(e)) from None
    except Exception as e:  # the template failed on these messages (a field of a type it did not expect)
        raise RequestError(f"the model's chat template failed on these messages: {_one_line(e)}") from None


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if not isinstance(error, (TemplateError, ValueError)) else text


# tokenizer -> the most characters one of its tokens stands for (each tokenizer's vocabulary read once)
_LONGEST_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest token of the vocabulary (added
    tokens included) as the tokenizer spells it, which is never shorter than the text it encodes (a
    byte-level token spells each byte as one character; a byte-fallback token "<0x41>" spells one)."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # (an object that takes no weak reference: count again next time)
        pass
    return longest


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
        self.token_array = None  # token_ids as numpy, for its penalties (executor/logits_processors.py)
        self.bad_words_ids: list[list[int]] | None = None  # its bad words' token ids (build_sequence)
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
        self.text: str | None = None  # set at a stop string; else decoded from text_tokens off the loop
        self.text_tokens = 0  # leading output tokens the text is decoded from, once finished
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
        # its tokens come from a plain sample of the logits alone (argmax or Gumbel-max): set by
        # build_sequence (model_runner.ModelRunner.logits_dtype)
        self.plain_sampling = False
        # its own logit changes before sampling (executor/logits_processors.py), and whether its sampling
        # waits for the step before to be read back (a grammar, a penalty or bad words need those tokens):
        # set once by build_sequence from its params, read by every step
        self.adjusts_logits = False
        self.samples_late = False

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


def build_sequence(prepared: PreparedRequest, eos_ids: list[int]) -> Sequence:
    """The engine thread's part of a request: its Sequence."""
    seq = Sequence(prepared.id, prepared.prompt_ids, prepared.params, eos_ids, prepared.extras, prepared.arrival)
    for name in prepared.outputs:
        setattr(seq, name, [])
    if prepared.top_logprobs is not None:
        seq.num_top_logprobs, seq.top_logprobs = prepared.top_logprobs, []
    seq.structured = prepared.structured
    seq.bad_words_ids = prepared.bad_words_ids
    params = seq.params
    seq.adjusts_logits = params.adjusts_logits
    seq.samples_late = params.needs_tokens or seq.structured is not None
    seq.plain_sampling = (not prepared.outputs and prepared.top_logprobs is None and seq.structured is None
                          and not params.truncates and not seq.adjusts_logits and params.min_tokens == 0)
    return seq


def make_samples(prepared: PreparedRequest, eos_ids: list[int], indices: list[int] | None = None) -> list[Sequence]:
    """The sequences of a request's n samples -> those of `indices` (default: all n). Each sample
    has its own seed, derived from the request's and its index (sample 0 keeps the request's: n=1
    is unchanged); the scheduler shares their prompt's KV through the prefix cache."""
    params = prepared.params
    samples = []
    for i in range(params.n) if indices is None else sorted({i for i in indices if 0 <= i < params.n}):
        own = (prepared if i == 0
               else dataclasses.replace(prepared, params=params.replace(seed=sample_seed(params.seed, i))))
        sample = build_sequence(own, eos_ids)
        sample.sample_index = i
        samples.append(sample)
    return samples
