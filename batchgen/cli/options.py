"""The options several commands share (engine, sampling, queue), their choices and help panels, and
`_with_options`, which gives them to a command; every option also reads BATCHGEN_<NAME>."""

from __future__ import annotations

import functools
import inspect
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from batchgen.config import DEVICES, DTYPES, GENERATION_CONFIGS, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from batchgen.schema import INPUT_FORMATS, INT32_MAX, OUTPUT_FORMATS, FieldError, check_range


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A Typer choice type whose members are `values` (config.py's tuples: one list of choices)."""
    return Enum(name, [(v, v) for v in values], type=str)


Dtype = _choices("Dtype", DTYPES)
KvCacheDtype = _choices("KvCacheDtype", KV_CACHE_DTYPES)  # fp8 = fp8_e4m3
Device = _choices("Device", DEVICES)
Quantization = _choices("Quantization", QUANTIZATIONS)
# auto: the model's generation_config.json gives the sampling defaults not given as options; none: built-ins
GenerationConfig = _choices("GenerationConfig", GENERATION_CONFIGS)
LoadFormat = _choices("LoadFormat", LOAD_FORMATS)
InputFormat = _choices("InputFormat", INPUT_FORMATS)
OutputFormat = _choices("OutputFormat", OUTPUT_FORMATS)


def _env(name: str) -> str:
    return f"BATCHGEN_{name}"


ENGINE = "Engine"
SAMPLING = "Sampling defaults (per-row columns override them)"
JOB = "Job"
OPENAI = "OpenAI Batch API files"
QUEUE = "Queue"


def file_path(value: str) -> Path:
    """A file argument's parser: an empty name is a usage error (pathlib would read it as '.', the folder)."""
    if not value:
        raise typer.BadParameter("is empty; give a file name")
    return Path(value)


def input_format_option(help: str):
    """--input-format, as run and submit take it."""
    return typer.Option(InputFormat.auto, "--input-format", envvar=_env("INPUT_FORMAT"), rich_help_panel=OPENAI,
                        help=help)


def served_model_name_option(help: str):
    """--served-model-name, as run and submit take it (repeatable)."""
    return typer.Option(None, "--served-model-name", envvar=_env("SERVED_MODEL_NAME"), rich_help_panel=OPENAI,
                        metavar="NAME", help=help)


def _option(name: str, annotation, default, *decls: str, panel: str, **kwargs) -> inspect.Parameter:
    """One command-line option that also reads BATCHGEN_<NAME>, as a parameter for `_with_options`."""
    option = typer.Option(default, *(decls or (f"--{name.replace('_', '-')}",)), envvar=_env(name.upper()),
                          rich_help_panel=panel, **kwargs)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _in_range(field: str):
    """A Typer callback: the option's value within schema.INT_RANGES[field], the range a row's field of
    that name has; otherwise a one-line usage error."""
    def check(value):
        if value is not None:
            try:
                check_range(field, value)
            except FieldError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check


ENGINE_OPTIONS = (
    _option("model", Optional[str], None, panel=ENGINE,
            help="Local HF model directory (or hub id where a hub is reachable). "
                 "Default: the embedded SmolLM2-135M-Instruct."),
    _option("dtype", Dtype, Dtype.auto, panel=ENGINE,
            help="Weights and activations dtype; auto: the checkpoint's half dtype on CUDA; on CPU bfloat16 "
                 "where the CPU has native bf16, else float32."),
    _option("device", Device, Device.auto, panel=ENGINE, help="auto: CUDA if available, else CPU."),
    _option("tensor_parallel_size", int, 1, "-tp", "--tensor-parallel-size", panel=ENGINE, max=INT32_MAX,
            help="GPUs to split the model over."),
    _option("expert_parallel", bool, False, panel=ENGINE,
            help="Mixture-of-experts models under --tensor-parallel-size N: each GPU holds 1/N of the experts "
                 "whole, instead of 1/N of every expert's features (the experts must divide by N)."),
    _option("data_parallel_size", str, "1", "-dp", "--data-parallel-size", panel=ENGINE, metavar="N|auto",
            help="Engine replicas, each on its own GPU (or its own --tensor-parallel-size GPUs), fed from one "
                 "input into one output; auto: every visible GPU. On a CPU the replicas share the cores."),
    _option("max_num_seqs", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="Most sequences in one batch. Default: 1024 on a GPU of 70 GiB or more, else 256."),
    _option("max_num_batched_tokens", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="Token budget of one step (prefill chunks + decodes). Default: chosen by the engine."),
    _option("gpu_memory_utilization", float, 0.9, panel=ENGINE, help="Share of GPU memory the engine may use."),
    _option("max_model_len", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="Longest prompt + output, in tokens. Default: the model's."),
    _option("kv_cache_tokens", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="KV cache size in tokens. Default: from the memory budget."),
    _option("kv_cache_dtype", KvCacheDtype, KvCacheDtype.auto, panel=ENGINE,
            help="KV cache dtype; auto: the model's. fp8 (= fp8_e4m3): half the bytes of bf16, so twice the "
                 "tokens fit and long decodes read half as much; values are rounded (outputs differ slightly). "
                 "Needs a GPU of compute capability 8.9+ (Ada, Hopper) or the CPU."),
    _option("load_format", LoadFormat, LoadFormat.auto, panel=ENGINE,
            help="auto: the model directory's *.safetensors; dummy: random weights from its config.json alone "
                 "(the same for a --seed; the tokenizer still comes from the directory), for benchmarks of "
                 "models whose checkpoint is not at hand. The output is meaningless text."),
    _option("quantization", Optional[Quantization], None, panel=ENGINE,
            help="fp8: quantize a bf16/fp16/fp32 checkpoint at load, as vLLM's quantization=\"fp8\": the decoder's "
                 "linear weights to fp8 e4m3 per output channel, their input activations per token (the LM head "
                 "and embeddings stay). FP8 checkpoints (compressed-tensors, HF fp8 128x128 blocks) load as "
                 "they are without it."),
    _option("batch_invariant", bool, False, panel=ENGINE,
            help="GPU: a row's tokens are the same whatever else is in its batch, however its prompt is chunked "
                 "or its prefix cached, so a resumed, sharded or re-batched job gives the same rows (at one GPU "
                 "model and batchgen version; not with --tensor-parallel-size > 1). Slower: see README."),
    _option("enable_prefix_caching", bool, True, "--enable-prefix-caching/--no-enable-prefix-caching", panel=ENGINE,
            help="Reuse the KV of prompt prefixes computed before (a shared system prompt, few-shot examples, "
                 "the n samples of a row) instead of computing them again."),
)
# A sampling default not given (None) comes from the model's generation_config.json, else batchgen's built-in.
SAMPLING_OPTIONS = (
    _option("max_tokens", Optional[int], None, panel=SAMPLING, callback=_in_range("max_tokens"),
            help="Most tokens to generate for a row. Default: the model's max_new_tokens, else 256."),
    _option("min_tokens", Optional[int], None, panel=SAMPLING, callback=_in_range("min_tokens"),
            help="Fewest tokens to generate before EOS or a stop may end a row. Default: 0."),
    _option("temperature", Optional[float], None, panel=SAMPLING,
            help="0 = greedy. Default: the model's, else 1.0."),
    _option("top_p", Optional[float], None, panel=SAMPLING, help="Default: the model's, else 1.0."),
    _option("top_k", Optional[int], None, panel=SAMPLING, callback=_in_range("top_k"),
            help="-1 or 0 = off. Default: the model's, else off."),
    _option("min_p", Optional[float], None, panel=SAMPLING,
            help="Drop tokens below min_p times the likeliest one's probability. Default: the model's, else 0 (off)."),
    _option("repetition_penalty", Optional[float], None, panel=SAMPLING,
            help="(0, 2]: a token of the prompt or the output has a positive logit divided by it, a negative one "
                 "multiplied. Default: the model's, else 1 (off)."),
    _option("frequency_penalty", Optional[float], None, panel=SAMPLING,
            help="[-2, 2]: subtracted from a token's logit per occurrence in the output. Default: 0."),
    _option("presence_penalty", Optional[float], None, panel=SAMPLING,
            help="[-2, 2]: subtracted from the logit of a token the output holds. Default: 0."),
    _option("stop", Optional[list[str]], None, panel=SAMPLING, help="A stop string (repeat for several)."),
    _option("ignore_eos", bool, False, panel=SAMPLING, help="Generate past EOS, up to --max-tokens."),
    _option("n", int, 1, panel=SAMPLING, callback=_in_range("n"),
            help="Samples of each prompt: n output rows (sample_index 0..n-1), the prompt computed once."),
    _option("seed", int, 0, panel=SAMPLING, callback=_in_range("seed"),
            help="Job seed: a row without its own seed gets one derived from (seed, id)."),
    _option("generation_config", GenerationConfig, GenerationConfig.auto, panel=SAMPLING,
            help="auto: sampling defaults not given as options come from the model's generation_config.json "
                 "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); none: from batchgen's "
                 "built-ins."),
    _option("response_format", Optional[str], None, panel=SAMPLING, metavar="JSON",
            help='Constrain every row that has no constraint of its own, OpenAI\'s form: '
                 '\'{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}\' '
                 'or \'{"type": "json_object"}\'.'),
    _option("structured_outputs", Optional[str], None, panel=SAMPLING, metavar="JSON",
            help='Likewise, vLLM\'s form: one of \'{"json": {...}}\', \'{"regex": ...}\', \'{"choice": [...]}\', '
                 '\'{"grammar": EBNF}\'.'),
)
QUEUE_OPTIONS = (
    _option("redis_url", str, ..., panel=QUEUE, show_default=False, metavar="URL",
            help="redis://[user:password@]host[:port][/db], rediss:// for TLS, or unix:///path/to/socket. "
                 "Prefer BATCHGEN_REDIS_URL for a password: the command line is visible to other users."),
    _option("prefix", str, "batchgen", panel=QUEUE, help="Prefix of every Redis key batchgen uses."),
)


def _with_options(*groups: tuple[inspect.Parameter, ...]):
    """Gives a command the shared options of `groups` (after its arguments, before its own options);
    its function receives their values as one dict, `options`."""
    shared = [p for group in groups for p in group]

    def decorate(func):
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "options"]
        arguments = [p for p in own if isinstance(p.default, typer.models.ArgumentInfo)]
        rest = [p for p in own if p not in arguments]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in arguments] + shared
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in rest]

        @functools.wraps(func)
        def command(**kwargs):
            options = {p.name: kwargs.pop(p.name) for p in shared}
            return func(options=options, **kwargs)

        command.__signature__ = inspect.Signature(params)
        return command

    return decorate
