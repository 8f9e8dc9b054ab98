"""The row contracts (README's Input and Output), shared by the engine, the file job and the queue: the fields of an
input row and the checks of their types (one place for both the Python API and the files), and the
output row of a request that failed."""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, NamedTuple

from batchgen.schema_refs import SchemaRefError, check_refs
from batchgen.unicode_text import TextError, check_nested_text, writable

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")  # exactly one per row
INPUT_FORMATS = ("auto", "openai", "batchgen")  # auto: openai where the first JSON object line is one
OUTPUT_FORMATS = ("auto", "parquet", "openai")  # auto: openai for an OUTPUT named *.jsonl, else parquet
PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")  # vLLM's and OpenAI's
SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", *PENALTY_FIELDS, "logit_bias",
    "allowed_token_ids", "bad_words", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "truncate_prompt_tokens",
    "include_stop_str_in_output", "skip_special_tokens",
)
LOGPROB_OPTIONS = ("logprobs", "prompt_logprobs")  # opt-in booleans: return log-probabilities
# opt-in output columns, each named after the row field that asks for it (top_logprobs: k, 0-20)
OUTPUT_OPTIONS = (*LOGPROB_OPTIONS, "top_logprobs")
STRUCTURED_FIELDS = ("response_format", "structured_outputs")  # at most one: constrained decoding
# Which of a request's n samples to generate (all when absent): set by a resumed job for a row
# whose other samples an earlier run finished.
SAMPLES_KEY = "__batchgen_samples__"
# vLLM's and OpenAI's sampling fields that batchgen does not do: a row may give them at their default only
# (an error row otherwise, rather than a column carried through while the row samples without them)
DEFAULT_ONLY_FIELDS: dict[str, tuple] = {
    "spaces_between_special_tokens": (True,),
}
KNOWN_FIELDS = (  # the rest is carried through
    "id", *PROMPT_FIELDS, *SAMPLING_FIELDS, *OUTPUT_OPTIONS, *STRUCTURED_FIELDS, SAMPLES_KEY,
)
METRIC_FIELDS = ("queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "decode_tokens_per_s")
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "n", "truncate_prompt_tokens")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", *PENALTY_FIELDS)
TEXT_OPTIONS = ("include_stop_str_in_output", "skip_special_tokens")  # vLLM's: how the output text is made
BOOL_FIELDS = ("ignore_eos", *TEXT_OPTIONS, *LOGPROB_OPTIONS)
MAX_TOP_LOGPROBS = 20
MAX_N = 1024  # samples of one prompt: each is a sequence of its own, built when the row is read
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1
# The inclusive range of every integer a row may give, and of the job option of the same name: one
# table for both. Past them a value means nothing (a token count past the int32 positions of the
# device, a seed past int64) and, past int64, cannot even reach the device.
INT_RANGES: dict[str, tuple[int, int]] = {
    "max_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),  # (and at most max_tokens: SamplingParams)
    "top_k": (-1, INT32_MAX),  # -1 or 0: off; past the vocabulary: the whole vocabulary
    "seed": (0, INT64_MAX),
    "n": (1, MAX_N),
    "truncate_prompt_tokens": (1, INT32_MAX),  # keep the prompt's last this many tokens
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
    "token_id": (0, INT32_MAX),  # each stop_token_id (then the engine's vocabulary, as for prompt_token_ids)
    "id": (INT64_MIN, INT64_MAX),  # an integer id: an int64 column
}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")  # vLLM's structured_outputs keys


class IdSet:
    """Ids seen so far, kept as 64-bit digests (under 100 bytes an id, whatever the id's length).

    Ids compare as text: the string "7" and the integer 7 are the same id, because a JSONL file that
    mixes them stores its ids as strings. Two different ids share a digest with odds of about
    rows² / 2^65 (1e-8 for a million rows).
    """

    def __init__(self) -> None:
        self._digests: set[int] = set()

    def add(self, row_id: Any) -> bool:
        """Adds `row_id`; False if it was already there (any id: a lone surrogate too, before its check)."""
        digest = hashlib.blake2b(str(row_id).encode("utf-8", "surrogatepass"), digest_size=8).digest()
        key = int.from_bytes(digest, "little")
        if key in self._digests:
            return False
        self._digests.add(key)
        return True


class FieldError(ValueError):
    """A field of a request row has the wrong type or shape; the message is one line, the row's `error`."""


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise FieldError(f"{name} must be an integer, got bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 16.0 from JSON, or from a float column that holds whole numbers
    raise FieldError(f"{name} must be an integer, got {type_name(value)}" + ("" if value is None else f" {value!r}"))


def check_range(name: str, value: int, limits: str | None = None) -> int:
    """`value` of field `name`, or FieldError when it is outside INT_RANGES[limits or name]."""
    low, high = INT_RANGES[limits or name]
    if low <= value <= high:
        return value
    if high < INT32_MAX:  # a small range: say all of it
        raise FieldError(f"{name} must be in [{low}, {high}], got {value}")
    if value < low:
        raise FieldError(f"{name} must be >= {low}, got {value}")
    raise FieldError(f"{name} must be <= {high}, got {value}")


def ranged_int(name: str, value: Any) -> int:
    """as_int, then check_range."""
    return check_range(name, as_int(name, value))


def check_text(name: str, value: Any) -> None:
    """FieldError naming the first string in `value` (nested too) that UTF-8 cannot encode."""
    try:
        check_nested_text(name, value)
    except TextError as e:
        raise FieldError(str(e)) from None


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"{name} must be a number, got {type_name(value)}")
    return float(value)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]


def as_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's and vLLM's logit_bias: an object of token id (an integer, or its decimal text as JSON keys
    are) -> bias in [-100, 100] -> {token id: bias}."""
    if not isinstance(value, dict):
        raise FieldError(f"logit_bias must be an object of token id: bias, got {type_name(value)}")
    bias = {}
    for key, b in value.items():
        token = key
        if isinstance(key, str):
            token = int(key) if key.isascii() and key.isdigit() else None
        if type(token) is not int:
            shown = repr(key) if len(repr(key)) <= 22 else repr(key)[:19] + "..."
            raise FieldError(f"logit_bias key {shown} is not a token id (a non-negative integer)")
        check_range(f"logit_bias key {token}", token, "token_id")
        b = as_float(f"logit_bias[{key!r}]", b)
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise FieldError(f"logit_bias[{key!r}] must be in [-100, 100], got {b}")
        bias[token] = b
    return bias


def as_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(f"{name} must be a list of integers, got {type_name(value)}")
    if all(type(v) is int for v in value):  # the usual case, 6x faster than checking each (a prompt's ids)
        return list(value)
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def message_text(content: Any, where: str) -> Any:
    """A message's content as a chat template takes it: a string, or a list of OpenAI's text parts
    ({"type": "text", "text": ...}) joined by newlines, as vLLM joins them for a text-only model.
    Other parts (image_url, input_audio, ...) are refused. Anything else is returned as it is."""
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        if kind == "text" and not isinstance(part.get("text"), str):
            raise FieldError(f"{where}.content[{i}] is a text part without a 'text' string")
        if kind != "text":
            raise FieldError(f"{where}.content[{i}] is not a text part (type {kind!r}); batchgen takes text only")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(value: Any) -> list[dict]:
    """A chat: a list of {role, content} objects. content: a string or a list of text parts; or null
    (or absent) in an assistant message with tool_calls. Other fields (name, tool_calls, ...) go to
    the chat template as they are."""
    if not isinstance(value, (list, tuple)):
        raise FieldError(f"messages must be a list of {{role, content}} objects, got {type_name(value)}")
    if not value:
        raise FieldError("messages is empty")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise FieldError(f"messages[{i}] must be an object with role and content, got {type_name(message)}")
        # A Parquet struct column gives every message every field; unset ones come back as None.
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str):
            raise FieldError(f"messages[{i}].role must be a string, got {type_name(message.get('role'))}")
        if not message["role"]:
            raise FieldError(f"messages[{i}].role is empty")
        if "content" in message:
            message["content"] = message_text(message["content"], f"messages[{i}]")
        if not isinstance(message.get("content"), str) and ("content" in message or not _calls_tools(message)):
            raise FieldError(f"messages[{i}].content must be a string or a list of text parts, got "
                             f"{type_name(message.get('content'))}")
        check_text(f"messages[{i}]", message)
        messages.append(message)
    if not any(m.get("content") or _calls_tools(m) for m in messages):
        raise FieldError("messages has no content")
    return messages


def _calls_tools(message: dict) -> bool:
    """An assistant message with tool calls, which may have no content (OpenAI's form)."""
    calls = message.get("tool_calls")
    return message.get("role") == "assistant" and isinstance(calls, (list, tuple)) and len(calls) > 0


def check_prompt(row: dict) -> dict:
    """The row's one prompt field, type-checked -> {field: value}."""
    present = [f for f in PROMPT_FIELDS if row.get(f) is not None]
    if not present:
        raise FieldError("no prompt: a row needs one of prompt, messages, prompt_token_ids")
    if len(present) > 1:
        raise FieldError(f"more than one prompt field ({', '.join(present)}): a row needs exactly one")
    field, value = present[0], row[present[0]]
    if field == "prompt":
        if not isinstance(value, str):
            raise FieldError(f"prompt must be a string, got {type_name(value)}")
        if not value or value.isspace():
            raise FieldError("prompt is empty")
        check_text("prompt", value)
        return {"prompt": value}
    if field == "messages":
        return {"messages": check_messages(value)}
    ids = as_int_list("prompt_token_ids", value)
    if not ids:
        raise FieldError("prompt_token_ids is empty")
    return {"prompt_token_ids": ids}


def check_options(row: dict) -> dict:
    """The row's non-null sampling fields, output options and constraint, type-checked, integers in
    INT_RANGES (the ranges that depend on each other or on the model are SamplingParams' and the
    engine's to check) -> {field: value}, itself a row that passes again."""
    return check_options_and_constraint(row)[0]


def check_options_and_constraint(row: dict) -> tuple[dict, StructuredSpec | None]:
    """check_options(row), and the spec of the row's own constraint (None: unconstrained), parsed once.
    A constraint field given stays in the fields even when it is {"type": "text"}: that row opts out of
    the job's constraint, which only applies to rows that give neither field."""
    fields: dict[str, Any] = {}
    for name, defaults in DEFAULT_ONLY_FIELDS.items():
        value = row.get(name)
        if value is not None and not any(type(value) is type(d) and value == d for d in defaults):
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise FieldError(f"{name} {shown} is not supported (only its default); leave it out")
    for name in INT_FIELDS:
        if row.get(name) is not None:
            fields[name] = ranged_int(name, row[name])
    for name in FLOAT_FIELDS:
        if row.get(name) is not None:
            fields[name] = as_float(name, row[name])
    stop = row.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise FieldError(f"stop must be a string or a list of strings, got {type_name(stop)}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise FieldError(f"stop[{i}] must be a string, got {type_name(s)}")
        if any(s == "" for s in stop):
            raise FieldError("stop holds an empty string")
        check_text("stop", list(stop))
        fields["stop"] = list(stop)
    if row.get("stop_token_ids") is not None:
        ids = fields["stop_token_ids"] = as_int_list("stop_token_ids", row["stop_token_ids"])
        for i, t in enumerate(ids):
            check_range(f"stop_token_ids[{i}]", t, "token_id")
    if row.get("allowed_token_ids") is not None:
        ids = fields["allowed_token_ids"] = as_int_list("allowed_token_ids", row["allowed_token_ids"])
        if not ids:
            raise FieldError("allowed_token_ids is empty: give at least one token id, or leave it out")
        for i, t in enumerate(ids):
            check_range(f"allowed_token_ids[{i}]", t, "token_id")
    if row.get("logit_bias") is not None:
        fields["logit_bias"] = as_logit_bias(row["logit_bias"])
    words = row.get("bad_words")
    if words is not None:
        if not isinstance(words, (list, tuple)):
            raise FieldError(f"bad_words must be a list of strings, got {type_name(words)}")
        for i, w in enumerate(words):
            if not isinstance(w, str) or not w.strip():
                got = "a blank string" if isinstance(w, str) else type_name(w)
                raise FieldError(f"bad_words[{i}] must be a non-blank string, got {got}")
        check_text("bad_words", list(words))
        fields["bad_words"] = list(words)
    for name in BOOL_FIELDS:
        if row.get(name) is not None:
            if not isinstance(row[name], bool):
                raise FieldError(f"{name} must be true or false, got {type_name(row[name])}")
            fields[name] = row[name]
    if row.get("top_logprobs") is not None:
        fields["top_logprobs"] = ranged_int("top_logprobs", row["top_logprobs"])
    spec = check_structured(row)
    field = next((f for f in STRUCTURED_FIELDS if row.get(f) is not None), None)
    if field is not None:
        fields[field] = row[field]
    return fields, spec


class StructuredSpec(NamedTuple):
    """A decoding constraint in one canonical form: equal specs compile once per job.
    kind: json (source: a JSON schema's canonical text, or "" for any JSON object), regex,
    choice (source: the choices as a JSON list), grammar (EBNF). field: the row field it came from."""

    kind: str
    source: str
    field: str

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source


def _json_value(name: str, value: Any, want: type, what: str) -> Any:
    """A value that may also come as its JSON text (a string column of a Parquet file)."""
    if isinstance(value, str) and want is not str:
        try:
            value = json.loads(value)
        except ValueError as e:
            raise FieldError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, want):
        raise FieldError(f"{name} must be {what}, got {type_name(value)}")
    return value


def _schema_text(name: str, schema: Any) -> str:
    schema = _json_value(name, schema, dict, "a JSON schema object (or its JSON text)")
    check_text(name, schema)
    try:
        check_refs(schema)
    except SchemaRefError as e:
        raise FieldError(f"{name}: {e}") from None
    # the order of properties is the order they are generated in: keep it
    return json.dumps(schema, separators=(",", ":"))


def check_structured(row: dict) -> StructuredSpec | None:
    """The row's decoding constraint, type-checked (compiling it is the engine's) -> a spec, or None
    for unconstrained. response_format is OpenAI's form, structured_outputs vLLM's."""
    present = [f for f in STRUCTURED_FIELDS if row.get(f) is not None]
    if len(present) > 1:
        raise FieldError("both response_format and structured_outputs given: a row takes one of them")
    if not present:
        return None
    field = present[0]
    value = _json_value(field, row[field], dict, "an object (or its JSON text)")
    # A Parquet struct column gives every row every key; unset ones come back as None.
    value = {k: v for k, v in value.items() if v is not None}
    check_text(field, value)
    if field == "response_format":
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredSpec("json", "", field)
        if kind != "json_schema":
            raise FieldError(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}"
            )
        spec = _json_value("response_format.json_schema", value.get("json_schema"), dict,
                           "an object with a schema")
        if spec.get("schema") is None:
            raise FieldError("response_format.json_schema.schema is missing")
        return StructuredSpec("json", _schema_text("response_format.json_schema.schema", spec["schema"]), field)
    kinds = [k for k in STRUCTURED_KINDS if k in value]
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        raise FieldError(f"structured_outputs has unknown key {unknown[0]!r}; use one of {', '.join(STRUCTURED_KINDS)}")
    if len(kinds) != 1:
        raise FieldError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, got {len(kinds)}")
    kind = kinds[0]
    name = f"structured_outputs.{kind}"
    if kind == "json":
        return StructuredSpec("json", _schema_text(name, value["json"]), field)
    if kind == "choice":
        choices = _json_value(name, value["choice"], (list, tuple), "a list of strings")
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise FieldError(f"{name} must be a non-empty list of non-empty strings")
        return StructuredSpec("choice", json.dumps(list(choices)), field)
    text = value[kind]
    if not isinstance(text, str) or not text:
        raise FieldError(f"{name} must be a non-empty string, got {type_name(text)}")
    return StructuredSpec(kind, text, field)


def error_result(row_id, message: str, extras: dict | None = None) -> dict:
    """The output row of a request that failed: no text, no tokens, no timings. The message and the
    carried-through columns are made writable (a lone surrogate becomes U+FFFD): an error row must
    reach every writer, whatever its row held. The id is the caller's to choose."""
    return {
        "id": row_id,
        **(writable(extras) if extras else {}),
        "sample_index": 0,  # one error row for a request, whatever its n
        "text": None,
        "output_token_ids": [],
        "finish_reason": "error",
        "error": writable(message),
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_prompt_tokens": 0,
        "num_preemptions": 0,
        **dict.fromkeys(METRIC_FIELDS),
    }
