"""Constrained decoding (structured outputs) with xgrammar.

Each distinct spec (schema.StructuredSpec: a JSON schema, any JSON object, a regex, a choice, an
EBNF grammar) is compiled once per engine, on a worker thread, into a grammar over the model's
vocabulary; the future is attached to each Sequence that asks for it. A sequence gets its own
matcher when it first samples. For every step with constrained samplers the engine, after reading
back the previous step, lets each matcher accept its new token (exactly once: preemption
recomputes KV, never tokens), then fill() writes their next-token bitmasks into pinned host memory,
one row per constrained sampler; the runner copies them to the device once and masks the logits in
one op (kernels/token_bitmask.py). xgrammar is imported only when a row is constrained.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from batchgen.engine.request import Sequence, Status
from batchgen.extras import extra_hint
from batchgen.schema import StructuredSpec

# xgrammar's errors start with a timestamp and its C++ source location: "[11:09:04] /x/y.cc:83: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# distinct specs kept compiled; a sequence holds its own grammar, so an evicted one is only recompiled
# for rows that come later (a job with a schema per row does not keep every one)
CACHE_SIZE = 256
# A step's bitmasks are filled on one thread or on a few, whichever was faster per row lately: a
# thread pool's start costs ~0.2 ms (1 ms where xgrammar's default takes half of a big host's
# cores), more than a simple grammar's whole fill (256 rows in 0.05 ms), far less than a large
# vocabulary's hard states (tens of us a row). The other way is tried again every EXPLORE_STEPS.
EXPLORE_STEPS = 64


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message is one line naming the row's field."""


def field_name(spec: StructuredSpec) -> str:
    if spec.field == "response_format":
        return "response_format.json_schema.schema" if spec.source else "response_format"
    return f"structured_outputs.{spec.kind}"


def one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0] if lines else type(error).__name__)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of the strings: root ::= "a" | "b" | ..."""
    def literal(s: str) -> str:
        return '"' + "".join(c if c.isalnum() or c == " " else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                             else f"\\U{ord(c):08x}" for c in s) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def grammar_vocab_size(tokenizer, model_vocab: int, stop_ids: list[int]) -> int:
    """The ids xgrammar is told about: the tokenizer's (and the stop ids), not the LM head's padding.
    xgrammar counts every id past the tokenizer as a special token and accept_token scans them
    linearly: a 384-token tokenizer under a 128,256-row LM head cost 23 us a token against 0.9 us.
    The ids left out are never allowed (the bitmask kernel masks every id past the bitmask)."""
    ids = tokenizer.get_vocab().values()
    return min(model_vocab, max(max(ids, default=-1), *stop_ids, len(tokenizer) - 1) + 1)


class StructuredDecoding:
    """The engine's compile cache, and the bitmasks of a step's constrained samplers."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], max_num_seqs: int, pin_memory: bool):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (LM head's), which may exceed the tokenizer's
        self.mask_vocab = vocab_size  # the grammar's: grammar_vocab_size(), set by the first compile
        self.stop_ids = list(stop_ids)
        self.max_num_seqs = max_num_seqs
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-grammar")
        self._lock = threading.Lock()  # sequences may be made on several threads (a tokenizer pool)
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()  # least recently used first
        self._compiler = None  # xgrammar's, made on the worker thread by the first compile
        # [max_num_seqs, W] int32. One buffer is enough: a fill comes after the read-back of the step
        # that the previous fill's copy was queued in, so that copy is done.
        self._bitmask: torch.Tensor | None = None
        self._fillers = None  # (one thread, a few threads) xgrammar BatchGrammarMatchers
        self._row_seconds = [0.0, 0.0]  # per filler: its recent fill time per row (0: not yet measured)
        self._fill_steps = 0
        self._stop_words: np.ndarray | None = None  # [W] uint32: every bit except the stop tokens'
        self._last_word = np.uint32(0xFFFFFFFF)  # the last word's bits of ids in the grammar's vocabulary
        # host time spent filling bitmasks (per constrained step) and accepting tokens, for benchmarks
        self.mask_seconds = self.accept_seconds = 0.0
        self.mask_steps = 0

    # ---- compiling (worker thread) -------------------------------------------------------------
    def compile(self, spec: StructuredSpec) -> Future:
        """-> a future of the compiled grammar (raises GrammarError); one per distinct spec."""
        with self._lock:
            future = self._compiled.get(spec.key)
            if future is None:
                future = self._compiled[spec.key] = self._pool.submit(self._compile, spec)
                if len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(spec.key)
            return future

    def _compile(self, spec: StructuredSpec):
        try:
            import xgrammar as xgr
        except ImportError:
            raise GrammarError(f"{field_name(spec)}: {extra_hint('structured')}") from None
        if self._compiler is None:
            self.mask_vocab = grammar_vocab_size(self.tokenizer, self.vocab_size, self.stop_ids)
            info = xgr.TokenizerInfo.from_huggingface(  # (no EOS known: xgrammar looks for one)
                self.tokenizer, vocab_size=self.mask_vocab, stop_token_ids=self.stop_ids or None
            )
            self.stop_ids = list(info.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiler = self._compiler
        try:
            if spec.kind == "json":  # compact JSON: free whitespace lets a small model pad forever
                compiled = compiler.compile_json_schema(spec.source or '{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.source)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(spec.source)))
            else:
                compiled = compiler.compile_grammar(spec.source)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError
            raise GrammarError(f"{field_name(spec)}: invalid or unsupported {spec.kind}: {one_line(e)}") from None
        if not self._allows_a_first_token(compiled):
            raise GrammarError(f"{field_name(spec)}: no output can match this {spec.kind} (a rule that only "
                               f"refers to itself?)")
        return compiled

    def _allows_a_first_token(self, compiled) -> bool:
        """Whether a fresh matcher of `compiled` allows any token (a stop token counts): a grammar
        whose language is empty (root ::= root) allows none, and its row would fail at its first
        token. (Once per distinct spec.)"""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.mask_vocab)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def attach(self, seq: Sequence) -> None:
        """Start compiling the sequence's spec; raises GrammarError at once when it is known bad."""
        seq.grammar = self.compile(seq.structured)
        if seq.grammar.done() and seq.grammar.exception() is not None:
            raise seq.grammar.exception()

    # ---- matching (engine loop) ----------------------------------------------------------------
    def accept(self, seq: Sequence, token: int) -> bool:
        """The sequence's new token -> whether its grammar took it."""
        start = time.perf_counter()
        accepted = seq.matcher.accept_token(token)
        self.accept_seconds += time.perf_counter() - start
        return accepted

    def _new_matcher(self, compiled):
        import xgrammar as xgr  # (compiled: xgrammar is there)

        if self._bitmask is None:
            words = (self.mask_vocab + 31) // 32  # (the kernel masks the LM head's ids past these)
            self._bitmask = torch.empty((self.max_num_seqs, words), dtype=torch.int32, pin_memory=self.pin_memory)
            threads = max(1, min(8, available_cpus() // 2))
            self._fillers = (xgr.BatchGrammarMatcher(max_threads=1),
                             xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None)
            stop = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
            for t in self.stop_ids:
                stop[t // 32] &= ~np.uint32(1 << (t % 32))
            self._stop_words = stop
            if self.mask_vocab % 32:
                self._last_word = np.uint32((1 << (self.mask_vocab % 32)) - 1)
        return xgr.GrammarMatcher(compiled)

    def fill(self, samplers: list[Sequence]) -> tuple[list[int], torch.Tensor | None, list[Sequence]]:
        """The bitmasks of a step's constrained samplers, after the previous step's tokens were
        accepted -> (their indices in `samplers`, bitmask [C, W] int32 on the host, sequences that
        ended: their grammar is complete and allows nothing but a stop token, or failed to compile
        (seq.error)). Sequences finished earlier get no mask; one that ends here keeps its row (its
        token in this step, a stop token, is surplus like that of a row finished at read-back)."""
        start = time.perf_counter()
        indices, matchers, ended = [], [], []
        for i, seq in enumerate(samplers):
            if seq.structured is None or seq.status is Status.FINISHED:
                continue
            if seq.matcher is None:  # (its grammar: a future, from attach())
                try:
                    seq.matcher = self._new_matcher(seq.grammar.result())
                except GrammarError as e:
                    seq.error = str(e)
                    ended.append(seq)
                    continue
            indices.append(i)
            matchers.append(seq.matcher)
        if not matchers:
            return [], None, ended
        bitmask = self._bitmask[: len(matchers)]
        self._fill_bitmasks(matchers, bitmask)
        words = bitmask.numpy().view(np.uint32)  # (the same memory)
        words[:, -1] &= self._last_word  # xgrammar leaves the last word's bits past its vocabulary set
        for c, matcher in enumerate(matchers):
            # complete, and only a stop token may follow: done now. (is_completed first: scanning
            # every row's [W] words cost 0.6 ms a step at 256 rows of a 128k vocabulary)
            if matcher.is_completed() and not (words[c] & self._stop_words).any():
                ended.append(samplers[indices[c]])
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return indices, bitmask, ended

    def _fill_bitmasks(self, matchers: list, bitmask: torch.Tensor) -> None:
        """xgrammar fills the rows, on one thread or on a few: the faster lately, the other now and then."""
        times = self._row_seconds
        best = 0 if self._fillers[1] is None or times[0] <= times[1] else 1
        self._fill_steps += 1
        use = 1 - best if self._fillers[1] is not None and self._fill_steps % EXPLORE_STEPS == 0 else best
        start = time.perf_counter()
        self._fillers[use].batch_fill_next_token_bitmask(matchers, bitmask)
        row_s = (time.perf_counter() - start) / len(matchers)
        times[use] = row_s if times[use] == 0.0 else 0.5 * (times[use] + row_s)


def available_cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
