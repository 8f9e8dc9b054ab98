"""Sampling parameters of one request: the job's defaults, overridden per row; and how a job's
defaults are chosen (its options, then the model's generation_config.json, then the built-ins)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from batchgen.models.generation_config import FIELDS
from batchgen.schema import (
    FLOAT_FIELDS,
    INT_FIELDS,
    MAX_N,
    SAMPLING_FIELDS,
    STRUCTURED_FIELDS,
    TEXT_OPTIONS,
    FieldError,
    StructuredSpec,
    as_int,
    check_options,
    check_range,
    check_structured,
    check_text,
)


@dataclass
class SamplingParams:
    """A request's sampling parameters. The field defaults are batchgen's built-ins."""

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability (0 = off)
    # vLLM's penalties: repetition divides a positive logit of a token in the prompt or the output (and
    # multiplies a negative one); frequency and presence subtract per occurrence / once from a token in the output
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # none of these may be completed (vLLM's: a word's last token is banned)
    truncate_prompt_tokens: int | None = None  # a longer prompt keeps its last this many tokens
    include_stop_str_in_output: bool = False  # the text keeps the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # the text leaves the special tokens out
    seed: int | None = None  # None: derived from the job seed and the request id
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # samples of the prompt: n output rows, the prompt's KV shared by all
    # the job's decoding constraint, for rows that give neither field (a row's own wins; its
    # response_format {"type": "text"} turns it off): OpenAI's and vLLM's forms, as in a row
    response_format: Any = None
    structured_outputs: Any = None

    def __post_init__(self):
        self.structured: StructuredSpec | None = check_structured(
            {"response_format": self.response_format, "structured_outputs": self.structured_outputs}
        )  # a FieldError (a ValueError) names the field
        self._set_checked({name: getattr(self, name) for name in SAMPLING_FIELDS})
        self._normalize()

    def _set_checked(self, values: dict) -> None:
        """Set these sampling fields, type-checked as a row's fields are (schema.check_options: its types,
        ranges and messages; a bool is not a number, a stop string is one stop), so that a bad value is a
        ValueError naming its field here, not a failure in the middle of a job. None: no seed (derived
        from the id), no stop strings or stop tokens; for the other fields a ValueError."""
        given = {}
        for name, value in values.items():
            if value is not None:
                given[name] = value
            elif name not in _NONE_ALLOWED:
                raise FieldError(f"{name} must be {_KINDS[name]}, got None")
        self.__dict__.update(values)
        if any(type(v) is not _EXACT.get(name) for name, v in given.items()):  # (check() does the ranges)
            self.__dict__.update(check_options(given))

    def _normalize(self) -> None:
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self.logit_bias or None  # ({}: none)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        if self.top_k == 0:
            self.top_k = -1
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # greedy (logits / 1e-40 would overflow fp32)
        self.check()

    def check(self) -> None:
        """Raise ValueError (a schema.FieldError for the ranges of schema.INT_RANGES, the same as a
        row's) naming the first field out of range."""
        check_range("max_tokens", self.max_tokens)
        check_range("min_tokens", self.min_tokens)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        check_range("top_k", self.top_k)
        check_range("n", self.n)
        if self.truncate_prompt_tokens is not None:
            check_range("truncate_prompt_tokens", self.truncate_prompt_tokens)
        if self.seed is not None:
            check_range("seed", self.seed)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop:
            check_text("stop", self.stop)
        for i, t in enumerate(self.stop_token_ids):
            check_range(f"stop_token_ids[{i}]", t, "token_id")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p masks the distribution before sampling."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the row's own logit changes apply (executor/logits_processors.py): allowed_token_ids,
        logit_bias, bad words, penalties."""
        return bool(self.allowed_token_ids) or bool(self.logit_bias) or self.needs_tokens

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (they then depend on the sequence's tokens so far)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_tokens(self) -> bool:
        """Whether its logit changes depend on the sequence's tokens so far (penalties, bad words)."""
        return self.penalized or bool(self.bad_words)

    def replace(self, **changes) -> SamplingParams:
        if not changes.keys() <= _CARRY_CONSTRAINT:  # a constraint (or an unknown name, TypeError)
            return dataclasses.replace(self, **changes)
        # The same constraint: carry its checked spec over. Parsing it again costs ~20 us with a
        # job-wide schema, and a job replaces its defaults for every row and every extra sample.
        params = object.__new__(type(self))
        params.__dict__.update(self.__dict__)
        params._set_checked(changes)
        params._normalize()
        return params


# Temperatures below this sample greedily (vLLM's rule): logits / 1e-40 overflow fp32, and the noise of a
# Gumbel draw is nothing beside logits / 1e-5 anyway
MIN_TEMPERATURE = 1e-5
_NONE_ALLOWED = ("seed", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words",
                 "truncate_prompt_tokens")
# what the others must be, in check_options' words
_KINDS = {**dict.fromkeys(INT_FIELDS, "an integer"), **dict.fromkeys(FLOAT_FIELDS, "a number"),
          **dict.fromkeys(("ignore_eos", *TEXT_OPTIONS), "true or false")}
# values of these exact types need no check of their type (a row's seed, say, as the engine replaces it per row)
_EXACT = {**dict.fromkeys(INT_FIELDS, int), **dict.fromkeys(FLOAT_FIELDS, float),
          **dict.fromkeys(("ignore_eos", *TEXT_OPTIONS), bool)}
# the fields replace() may change without checking the constraint again
_CARRY_CONSTRAINT = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - set(STRUCTURED_FIELDS)


MODEL_DEFAULT_FIELDS = tuple(name for name, _ in FIELDS.values())  # what a generation_config.json may set
OPTION, MODEL, BUILT_IN = "option", "generation_config", "built-in"  # where a job default came from


def resolve_defaults(given: dict, model: dict) -> tuple[SamplingParams, dict[str, str]]:
    """A job's default SamplingParams, each field from the first that has it: `given` (the job's
    options; None = not given), `model` (the model's generation_config.json, as read by
    models.generation_config), batchgen's built-ins. -> (params, {field: OPTION | MODEL | BUILT_IN})
    for the fields of MODEL_DEFAULT_FIELDS and those given. ValueError names a bad value's field, and
    the model's file when it came from there."""
    chosen, sources = {}, {}
    for name in dict.fromkeys((*MODEL_DEFAULT_FIELDS, *given)):
        if given.get(name) is not None:
            chosen[name], sources[name] = given[name], OPTION
        elif model.get(name) is not None:
            chosen[name], sources[name] = model[name], MODEL
        elif name in MODEL_DEFAULT_FIELDS:
            sources[name] = BUILT_IN
    try:
        params = SamplingParams(**chosen)
    except ValueError as e:
        field_name = str(e).split()[0]  # SamplingParams' messages start with the field's name
        if sources.get(field_name) == MODEL:
            raise ValueError(f"{e} (from the model's generation_config.json)") from None
        raise
    return params, sources


def _hash_seed(text: str) -> int:
    """A seed in [0, 2^63) from a text: the same on every machine and run."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def derive_seed(job_seed: int, request_id) -> int:
    """A request's seed from the job seed and its id: stable across runs, shards and resumes."""
    return _hash_seed(f"{job_seed}\x00{request_id!r}")


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request with `seed`: sample 0 keeps it (n=1 is unchanged)."""
    if seed is None or index == 0:
        return seed
    return _hash_seed(f"{seed}\x00sample\x00{index}")


def samples_of(request: dict, default_n: int) -> int:
    """Results the engine gives for `request`: its n (`default_n`, the job's, when it has none), or
    1 for an n it refuses (it answers that request with one error row)."""
    n = request.get("n")
    try:
        n = default_n if n is None else as_int("n", n)
    except FieldError:
        return 1
    return n if 1 <= n <= MAX_N else 1
