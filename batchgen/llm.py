"""The Python API: LLM(model=None, **engine_options).generate(requests)."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from batchgen.config import EngineConfig
from batchgen.engine.engine import CLOSED, EngineClosedError, LLMEngine
from batchgen.io.rows import OUTPUT_FIELDS as RESULT_FIELDS
from batchgen.io.rows import ROW_KEY, InputRow, RowChecker
from batchgen.models.generation_config import read_sampling_defaults
from batchgen.replicas import ReplicaPool, data_parallel_size
from batchgen.sampling_params import SamplingParams, resolve_defaults
from batchgen.schema import KNOWN_FIELDS
from batchgen.version import __version__

# Carried through the engine with each request (and taken off its results): the request's place in the
# requests (generate_list orders by it), and for a request refused here, the error its result carries.
_PLACE = "__batchgen_place__"
_REFUSED = "__batchgen_refused__"
# Keys of batchgen's own layers start so (io's row index, the queue's message id): their requests come
# with ids checked in their own scope (the input file, each queued job) and pass here as they are.
_INTERNAL = "__batchgen_"


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
        requests: Iterable[dict | str] | dict | str,
        sampling: SamplingParams | None = None,
        stop_event: threading.Event | None = None,
    ) -> Iterator[dict]:
        """Yield one result row per request, as each finishes. Requests (README's input rows) are
        pulled lazily, only while the engine has room, so any number of them streams through in
        bounded memory. A live source (a queue) may yield None for "nothing right now": the engine
        keeps running what it has and asks again after the next step. A string is a request of that
        prompt alone (vLLM's `generate(["..."])`); a lone string or dict is one request, not a list. A
        request without an id gets its place in the requests. A bad request (not a dict or string, an id
        already seen, 7 and "7" being one, or any check a file's row fails) yields an error row at once and
        affects no other; without a usable id it gets the fallback id `#row:N` (N: its place), as in a file. `sampling`
        holds the defaults a request's own fields override; None: get_default_sampling_params().
        EngineClosedError (a RuntimeError) once the LLM is closed, here rather than at the first next()."""
        if self.engine.closed:
            raise EngineClosedError(CLOSED)
        return (result for _, result in self._generate(requests, sampling, stop_event, listed=False))

    def _generate(self, requests, sampling, stop_event, listed: bool) -> Iterator[tuple[int, dict]]:
        """-> (the request's place, its result) per result. listed: `requests` is a finite list, in which a None
        is a bad request (in a live source: "nothing right now")."""
        defaults = sampling or self.get_default_sampling_params()
        rows = _rows(requests, listed)
        for result in self.engine.generate(rows, defaults, stop_event, threaded=self.tokenizer_pool):
            refused = result.pop(_REFUSED, None)
            if refused is not None:
                result["error"] = refused
            yield result.pop(_PLACE, -1), result

    def generate_list(self, requests: Iterable[dict | str] | dict | str,
                      sampling: SamplingParams | None = None) -> list[dict]:
        """All results, in the order of the requests (a request's n samples in order of sample_index): one
        per request and sample, as generate() gives them; here a None is a bad request (an error row), as the
        requests are a list, not a live source."""
        if self.engine.closed:
            raise EngineClosedError(CLOSED)
        results = list(self._generate(requests, sampling, None, listed=True))
        results.sort(key=lambda placed: (placed[0], placed[1]["sample_index"]))
        return [result for _, result in results]


def _rows(requests, listed: bool) -> Iterator[dict | None]:
    """The engine's rows of LLM.generate's requests, checked as a file's rows are (io.rows.RowChecker: the
    id's type and range, a repeated id, reserved column names, text that is not valid Unicode), each with
    its place; a bad one becomes a row without a prompt that carries its error (the engine answers it
    with an error row at once, in its turn)."""
    if isinstance(requests, (str, dict)):
        requests = [requests]  # one prompt, or one request: not its characters or keys
    checker = RowChecker()
    place = 0
    for request in requests:
        if request is None and not listed:
            yield None  # a live source with nothing right now: no request, no place
            continue
        if isinstance(request, str):
            request = {"prompt": request}
        if isinstance(request, dict) and any(str(k).startswith(_INTERNAL) for k in request):
            yield request  # batchgen's own layers: checked there
            continue
        if not isinstance(request, dict):  # (its id: the fallback a file's row without a usable id gets)
            kind = "None" if request is None else type(request).__name__
            yield {"id": f"#row:{place}", _PLACE: place, _REFUSED: f"a request must be a dict or a string, got {kind}"}
            place += 1
            continue
        checked, error = checker.check(InputRow(place, request))
        if checked is not None:
            checked.pop(ROW_KEY)
            yield {**checked, _PLACE: place}
        else:  # no prompt: the engine's error row, whose message _generate replaces; the rest carried through
            error.pop(ROW_KEY)
            extras = {k: v for k, v in error.items() if k not in KNOWN_FIELDS and k not in RESULT_FIELDS}
            yield {**extras, "id": error["id"], _PLACE: place, _REFUSED: error["error"]}
        place += 1
