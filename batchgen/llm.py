"""The Python API: LLM(model=None, **engine_options).generate(requests)."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from batchgen.config import EngineConfig
from batchgen.engine.engine import CLOSED, EngineClosedError, LLMEngine
from batchgen.models.generation_config import read_sampling_defaults
from batchgen.replicas import ReplicaPool, data_parallel_size
from batchgen.sampling_params import SamplingParams, resolve_defaults
from batchgen.version import __version__


class LLM:
    """An engine on one model. `model=None` is the embedded default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(max_num_seqs=64)
    >>> params = llm.get_default_sampling_params().replace(max_tokens=8)  # the model's defaults, shorter
    >>> for result in llm.generate([{"id": 1, "prompt": "Hello"}], params):
    ...     print(result["id"], result["text"])
    """

    def __init__(self, model: str | None = None, tokenizer_pool: bool = True, **engine_options):
        """tokenizer_pool: tokenize and detokenize in worker threads beside the engine loop (False: on
        the engine's thread, between steps)."""
        self.config = EngineConfig(model=model, **engine_options)
        self.tokenizer_pool = tokenizer_pool
        replicated = data_parallel_size(self.config) > 1
        self.engine = ReplicaPool(self.config) if replicated else LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._model_sampling: dict | None = None  # the sampling defaults of the model's generation_config.json

    def close(self) -> None:
        """Free the engine: end its worker processes (tensor parallelism, data-parallel replicas) and free
        the model's weights, the KV cache and the CUDA graphs, so that another LLM in this process finds
        the memory free. Idempotent; generate() raises afterwards. Dropping the last reference to the LLM
        frees the same (`with LLM(...) as llm:` closes it at the end of the block)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far by this LLM, counted per step (a row's before it finishes)."""
        return self.engine.generated_tokens

    def describe(self) -> dict:
        return {**self.engine.describe(), "generation_config": self.config.generation_config,
                "batchgen_version": __version__}

    def get_default_sampling_params(self, **options) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: batchgen's built-ins, overridden by the
        model's generation_config.json (temperature, top_p, top_k, max_new_tokens) unless the LLM was
        made with generation_config="none", overridden by `options` (SamplingParams' fields; None: not
        given), as `batchgen run` resolves its options. A copy: change it with `.replace(max_tokens=64)`.
        ValueError if a value is out of range (naming the model's file if it came from there)."""
        if self._model_sampling is None:
            auto = self.config.generation_config == "auto"
            self._model_sampling = read_sampling_defaults(self.engine.model_dir) if auto else {}
        params, _ = resolve_defaults(options, self._model_sampling)
        return params

    @property
    def stats(self) -> dict:
        """The last generate()'s totals: generation_seconds, prompt_tokens, output_tokens."""
        return self.engine.stats

    def generate(
        self,
        requests: Iterable[dict | str],
        sampling: SamplingParams | None = None,
        stop_event: threading.Event | None = None,
    ) -> Iterator[dict]:
        """Yield one result row per request, as each finishes. Requests (README's input rows) are
        pulled lazily, only while the engine has room, so any number of them streams through in
        bounded memory. A live source (a queue) may yield None for "nothing right now": the engine
        keeps running what it has and asks again after the next step. A string is a request of that
        prompt alone (vLLM's `generate(["..."])`). A bad request yields an error
        row at once and affects no other. `sampling` holds the defaults a request's own fields
        override; None: get_default_sampling_params(). EngineClosedError (a RuntimeError) once the LLM
        is closed, here rather than at the first next()."""
        if self.engine.closed:
            raise EngineClosedError(CLOSED)
        return self._generate(requests, sampling, stop_event)

    def _generate(self, requests, sampling, stop_event) -> Iterator[dict]:
        defaults = sampling or self.get_default_sampling_params()
        rows = ({"prompt": r} if isinstance(r, str) else r for r in requests)  # (a plain prompt, as vLLM takes)
        yield from self.engine.generate(rows, defaults, stop_event, threaded=self.tokenizer_pool)

    def generate_list(self, requests: Iterable[dict | str], sampling: SamplingParams | None = None) -> list[dict]:
        """All results, in the order of the requests (a request's n samples in order of sample_index)."""
        requests = list(requests)
        ids = [r.get("id", i) if isinstance(r, dict) else i for i, r in enumerate(requests)]
        by_id: dict = {}
        for r in self.generate(requests, sampling):
            by_id.setdefault(r["id"], []).append(r)
        return [r for i in ids for r in sorted(by_id[i], key=lambda r: r["sample_index"])]
