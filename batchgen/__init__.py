"""batchgen: offline batch LLM generation on its own inference engine."""
from batchgen.config import EngineConfig
from batchgen.engine.request import RequestError
from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams
from batchgen.version import __version__

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestError", "__version__"]
