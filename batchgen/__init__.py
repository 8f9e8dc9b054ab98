"""batchgen: offline batch LLM generation on its own inference engine.

The public names are imported on first use (PEP 562), so that `import batchgen.cli` does not pay for
torch: the CLI handles SIGTERM before its heavy imports, and `batchgen --help` answers at once."""
from importlib import import_module

from batchgen.version import __version__

_HOMES = {
    "EngineConfig": "batchgen.config",
    "RequestError": "batchgen.engine.request",
    "LLM": "batchgen.llm",
    "SamplingParams": "batchgen.sampling_params",
}

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestError", "__version__"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
