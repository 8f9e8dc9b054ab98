"""The engine and sampling options of `run` and `worker`, checked and resolved into what makes the LLM and
the job's sampling defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from batchgen.cli.errors import EXIT_USAGE, _BadSetting, _fail, _UsageError
from batchgen.cli.options import GenerationConfig, KvCacheDtype

if TYPE_CHECKING:  # the engine's imports (torch) wait until a command needs them
    from batchgen import SamplingParams


@dataclass
class _EngineSetup:
    model: Optional[str]
    engine_options: dict
    sampling: SamplingParams
    settings: dict  # what shapes the output: resume's fingerprint, a worker's description
    described: dict  # more for the output's metadata: the sampling defaults and where each came from

    def make_llm(self):
        from batchgen import LLM

        try:
            return LLM(model=self.model, **self.engine_options)
        except (ValueError, FileNotFoundError) as e:
            message, tp = str(e), self.engine_options["tensor_parallel_size"]
            if tp != 1 and "tensor-parallel" in message and "--tensor-parallel-size" not in message:
                message = f"invalid --tensor-parallel-size {tp}: {message}"  # the model does not split that way
            raise _BadSetting(message) from None


def _data_parallel_size(value: str) -> int | str:
    text = value.strip().lower()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise _UsageError(f"invalid --data-parallel-size: {value!r}; give a number >= 1 or auto") from None


def _engine_setup(options: dict) -> _EngineSetup:
    """The engine and sampling options, checked (a bad value is a usage error); the sampling
    defaults resolved: an option given, else the model's generation_config.json, else built-in."""
    from batchgen import EngineConfig, SamplingParams
    from batchgen.sampling_params import resolve_defaults
    from batchgen.schema import PENALTY_FIELDS

    o = options
    engine_options = dict(
        dtype=o["dtype"].value, device=o["device"].value, tensor_parallel_size=o["tensor_parallel_size"],
        expert_parallel=o["expert_parallel"],
        data_parallel_size=_data_parallel_size(o["data_parallel_size"]),
        max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        gpu_memory_utilization=o["gpu_memory_utilization"], max_model_len=o["max_model_len"],
        kv_cache_tokens=o["kv_cache_tokens"], kv_cache_dtype=o["kv_cache_dtype"].value, seed=o["seed"],
        quantization=o["quantization"].value if o["quantization"] is not None else None,
        enable_prefix_caching=o["enable_prefix_caching"], generation_config=o["generation_config"].value,
        load_format=o["load_format"].value, batch_invariant=o["batch_invariant"],
    )
    try:
        EngineConfig(model=o["model"], **engine_options)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    given = {name: o[name] for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                                        *PENALTY_FIELDS)}
    given.update(stop=o["stop"] or None, ignore_eos=o["ignore_eos"] or None,  # None: not given
                 n=o["n"] if o["n"] != 1 else None, response_format=o["response_format"],
                 structured_outputs=o["structured_outputs"])
    try:
        sampling, sources = resolve_defaults(given, _model_sampling_defaults(o["model"], o["generation_config"]))
    except ValueError as e:
        message = str(e)
        if message.startswith("both response_format"):
            message = "both --response-format and --structured-outputs given: use one of them"
        for name in ("response_format", "structured_outputs"):  # name them as options
            if message.startswith(name):
                message = "--" + name.replace("_", "-") + message[len(name):]
        hint = "; --generation-config none ignores the model's file" if "generation_config.json" in message else ""
        raise _UsageError(f"invalid sampling default: {message}{hint}") from None
    defaults = {name: getattr(sampling, name) for name in sources}
    settings = {
        "model": o["model"] or "default", "dtype": o["dtype"].value, "device": o["device"].value,
        "max_model_len": o["max_model_len"], "kv_cache_tokens": o["kv_cache_tokens"], "seed": o["seed"],
        "max_tokens": sampling.max_tokens, "min_tokens": sampling.min_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": sampling.stop, "ignore_eos": sampling.ignore_eos,
        "generation_config": o["generation_config"].value,
        **({"n": o["n"]} if o["n"] != 1 else {}),  # (absent for n=1: the fingerprints of earlier runs hold)
        **{name: getattr(sampling, name) for name in ("min_p", *PENALTY_FIELDS)  # (likewise, absent when off)
           if getattr(sampling, name) != getattr(SamplingParams, name)},
        **({"kv_cache_dtype": "fp8"} if o["kv_cache_dtype"] != KvCacheDtype.auto else {}),  # (fp8 = fp8_e4m3)
        **({"load_format": "dummy"} if o["load_format"].value == "dummy" else {}),  # (other weights: other rows)
        **({"quantization": o["quantization"].value} if o["quantization"] is not None else {}),
        **({"batch_invariant": True} if o["batch_invariant"] else {}),  # (other kernels: other bits)
        **({"structured": list(sampling.structured.key)} if sampling.structured is not None else {}),
    }
    # for the output's metadata and the summary: each default's value and where it came from
    described = {"sampling_defaults": defaults, "sampling_defaults_from": sources}
    return _EngineSetup(o["model"], engine_options, sampling, settings, described)


def _model_sampling_defaults(model: Optional[str], generation_config: GenerationConfig) -> dict:
    """The sampling defaults of the model's generation_config.json ({} for --generation-config none).
    Finds the model as the engine will (the default model is converted here on a first run)."""
    if generation_config is GenerationConfig.none:
        return {}
    from batchgen.models.generation_config import read_sampling_defaults
    from batchgen.models.resolve import resolve_model_dir

    try:
        model_dir = resolve_model_dir(model)
    except FileNotFoundError as e:
        raise _fail(str(e), EXIT_USAGE) from None
    try:
        return read_sampling_defaults(model_dir)
    except ValueError as e:
        raise _UsageError(f"{e}; --generation-config none ignores the file") from None
