"""Checks of a job's files and their formats: INPUT, OUTPUT, the OpenAI Batch API options (--input-format,
--output-format, --error-file, --served-model-name, --tokenizer); a bad one is a usage error."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from batchgen.cli.options import InputFormat, OutputFormat


def _check_input(input: Path) -> None:
    from batchgen.io.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES

    if not input.is_file():
        raise typer.BadParameter(f"{str(input)!r} is not a file", param_hint="'INPUT'")
    if input.suffix.lower() not in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
        raise typer.BadParameter(f"{str(input)!r}: name it *.jsonl or *.parquet", param_hint="'INPUT'")


def _served_models(names: Optional[list[str]], model: Optional[str]) -> list[str]:
    if names:
        if any(not n for n in names):
            raise typer.BadParameter("a model name cannot be empty", param_hint="'--served-model-name'")
        return list(names)
    from batchgen.models.default_model import DEFAULT_MODEL_NAME

    return [model or DEFAULT_MODEL_NAME]


def _token_text(model: str):
    """A token id -> its text, by the tokenizer of `model` ("default": the embedded model's)."""
    from transformers import AutoTokenizer

    from batchgen.models.resolve import resolve_model_dir
    from batchgen.token_text import token_text_of

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None if model == "default" else model))
    except (OSError, ValueError) as e:  # FileNotFoundError included
        raise typer.BadParameter(" ".join(str(e).split()), param_hint="'--tokenizer'") from None
    return token_text_of(tokenizer)


def _check_input_format(input: Path, input_format: InputFormat) -> None:
    from batchgen.io.sources import JSONL_SUFFIXES

    if input_format is InputFormat.openai and input.suffix.lower() not in JSONL_SUFFIXES:
        raise typer.BadParameter("an OpenAI batch file is JSONL; name it *.jsonl", param_hint="'--input-format'")


def _formats(input: Optional[Path], output: Path, input_format: InputFormat, output_format: OutputFormat,
             error_file: Optional[Path]) -> dict:
    """JobSpec's format fields, checked: auto resolved for the output (the input's needs the file)."""
    from batchgen.io.openai_output import is_openai_output

    if input is not None:
        _check_input_format(input, input_format)
    resolved = output_format.value
    if output_format is OutputFormat.auto:
        resolved = "openai" if is_openai_output(output) else "parquet"
    if error_file is not None:
        if resolved != "openai":
            raise typer.BadParameter("needs the OpenAI output format (--output-format openai or an OUTPUT named "
                                     "*.jsonl)", param_hint="'--error-file'")
        from batchgen.io.openai_output import sidecar_path

        taken = {output.resolve(), sidecar_path(output).resolve(), *([input.resolve()] if input is not None else [])}
        if error_file.resolve() in taken:
            raise typer.BadParameter("must differ from INPUT, OUTPUT and OUTPUT's metadata file "
                                     f"({sidecar_path(output).name})", param_hint="'--error-file'")
        if error_file.is_dir():
            raise typer.BadParameter(f"{str(error_file)!r} is a directory", param_hint="'--error-file'")
    return {"input_format": input_format.value, "output_format": resolved, "error_file": error_file}
