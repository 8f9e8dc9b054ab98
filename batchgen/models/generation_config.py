"""A model's own sampling defaults: the fields of its generation_config.json that batchgen has.

As vLLM's `--generation-config auto`: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens (as max_tokens). Other fields (do_sample, max_length, ...) are not read: vLLM, whose
behaviour users expect, does not read them either.
"""
from __future__ import annotations

import json
from pathlib import Path

from batchgen.schema import FieldError, as_float, as_int

GENERATION_CONFIG = "generation_config.json"
# generation_config.json's name -> batchgen's (SamplingParams') name, and how to read its value; in
# the order a job's summary and metadata list these defaults
FIELDS = {
    "max_new_tokens": ("max_tokens", as_int),
    "temperature": ("temperature", as_float),
    "top_p": ("top_p", as_float),
    "top_k": ("top_k", as_int),
    "min_p": ("min_p", as_float),
    "repetition_penalty": ("repetition_penalty", as_float),
}


def read_sampling_defaults(model_dir: Path) -> dict:
    """{SamplingParams field: value} of model_dir/generation_config.json; {} when the model has no
    such file. A file that is not a JSON object, or a field of the wrong type, raises ValueError (one
    line naming the file and the field); value ranges are SamplingParams' to check."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    defaults = {}
    for name, (field, read) in FIELDS.items():
        if data.get(name) is None:
            continue
        try:
            defaults[field] = read(name, data[name])
        except FieldError as e:
            raise ValueError(f"{path}: {e}") from None
    return defaults
