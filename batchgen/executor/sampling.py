"""All of sampling, on the device: a step's sampling parameters, the samplers (greedy argmax;
Gumbel-max in two levels with counter-based noise, kernels/gumbel_argmax.py, so that a request's
samples depend only on its own seed and step; top-k/top-p masks; grammar masks; stop ids banned
before min_tokens), log-probabilities, sampling from vocabulary shards under tensor parallelism, and
the StepOutput that carries a launched step's results back to the host.

A sampler row is anything with a Sequence's sampling fields (engine/request.py): params,
num_generated, stop_ids, logprobs, num_top_logprobs, structured.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.executor.logits_processors import apply_allowed_and_bias, apply_bad_words, apply_penalties
from batchgen.executor.staging import Staging
from batchgen.kernels.gumbel_argmax import gumbel_argmax, gumbel_max, temperature_scaled
from batchgen.kernels.token_bitmask import apply_token_bitmask

TOP_RANKS_FIRST = 64  # ranks the CPU path looks at; a row they do not settle is sorted whole
SORT_ROWS = 256  # rows sorted whole at once (mask_top_k_top_p_sorted)


def mask_min_p_(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p, in place: -inf for each token whose probability at the row's temperature is below
    min_p times the likeliest token's, i.e. whose scaled logit is below the row's largest + log(min_p)
    (min_p 0: none; greedy rows untouched). Before top-k/top-p, on the whole distribution, as vLLM
    applies it. SORT_ROWS rows at a time (their temporaries only)."""
    for start in range(0, logits.shape[0], SORT_ROWS):
        rows = slice(start, start + SORT_ROWS)
        scaled = temperature_scaled(logits[rows], temperatures[rows])
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_ps[rows])[:, None]
        logits[rows].masked_fill_((scaled < floor) & (temperatures[rows] > 0)[:, None], float("-inf"))
    return logits


def mask_top_k_top_p(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest prefix whose probability mass (at the
    row's temperature) reaches top_p; the rest become -inf. top_ks [S] (vocab size = off), top_ps
    [S] (1.0 = off)."""
    if logits.is_cuda:  # (the CPU path decides on the host how far to look: no sync on a GPU)
        return mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps)
    return mask_top_k_top_p_cpu(logits, temperatures, top_ks, top_ps)


def mask_top_k_top_p_sorted(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """mask_top_k_top_p by sorting every row's whole vocabulary; equal logits in token order (a stable
    sort), so that which of them a limit keeps does not depend on the sort. SORT_ROWS rows at a time:
    the sort's temporaries (several [rows, V] copies) stay those of SORT_ROWS rows however many a step
    samples, and the KV pool, sized after a profile of the widest step, keeps that memory."""
    if logits.shape[0] <= SORT_ROWS:
        return _mask_sorted(logits, temperatures, top_ks, top_ps)
    out = torch.empty_like(logits)
    for start in range(0, logits.shape[0], SORT_ROWS):
        rows = slice(start, start + SORT_ROWS)
        out[rows] = _mask_sorted(logits[rows], temperatures[rows], top_ks[rows], top_ps[rows])
    return out


def _mask_sorted(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """mask_top_k_top_p_sorted of rows taken at once."""
    scaled = temperature_scaled(logits, temperatures)
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # (top_p 1 is off: a tail whose mass before it rounds to 1 stays; the first token always stays, also for a
    # top_p that rounds to 0 in fp32)
    past_nucleus = (mass_before >= top_ps[:, None]) & (top_ps < 1.0)[:, None] & (rank > 0)[None, :]
    dropped = torch.isinf(sorted_logits) | past_nucleus
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), float("-inf"))


def _largest(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, in the order of a stable descending sort (equal values in token
    order): torch.topk, whose choice among values tied at the k-th place is redone by token id where
    it left some out, then the k ordered by value, then id. (A stable sort where k nears the row.)"""
    if 4 * k >= scaled.shape[-1]:
        values, ids = scaled.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k]
    values, ids = scaled.topk(k, dim=-1)
    kth = values[:, -1:]
    cut = (scaled == kth).sum(dim=-1) > (values == kth).sum(dim=-1)  # rows with tied values left out
    if cut.any():
        part, kth = scaled[cut], kth[cut]
        above, tied = part > kth, part == kth
        take = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        ids[cut] = take.nonzero()[:, 1].view(-1, k)
    ids = ids.sort(dim=-1).values
    values, where = scaled.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, where)


def _log_normaliser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, log_sum), [R, n] -> two [R]: logsumexp(x) = top + log_sum, top the row's largest (0 if it
    is not finite), so that probabilities exp((x - top) - log_sum) keep fp32 precision however large
    the logits. Without subnormal exponentials: a term below e^-87 of the largest counts as e^-87
    (nothing at fp32 precision next to the largest's 1), a masked one (-inf) as 0; low temperatures
    spread the scaled logits so far that most exponentials were subnormal, far slower on a CPU."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    below = (x - top).clamp(min=-87.0).masked_fill(x == float("-inf"), float("-inf"))
    return top.squeeze(-1), below.exp().sum(dim=-1).log()


def mask_top_k_top_p_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """mask_top_k_top_p from each row's TOP_RANKS_FIRST largest logits, where that settles the row
    (its top_k is at most that, or its nucleus closes within them); the other rows through the sorted
    version. Sorting whole vocabularies was most of a CPU job's sampling time. Ties are ordered as the
    sorted version orders them. The mass is normalised by the row's (or its top_k's) log-sum-exp
    rather than summed in sorted order, so a set can differ from the sorted version's only where a
    token's mass before it is within fp32 rounding of top_p."""
    vocab = logits.shape[-1]
    scaled = temperature_scaled(logits, temperatures)
    if torch.isnan(scaled).any() or torch.isposinf(scaled).any():  # (no order or no mass to speak of)
        return mask_top_k_top_p_sorted(logits, temperatures, top_ks, top_ps)
    top_ks = top_ks.clamp(max=vocab)
    k = min(vocab, TOP_RANKS_FIRST)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    unlimited = (top_ps >= 1.0) & (top_ks >= vocab)
    keep[unlimited] = torch.isfinite(logits[unlimited])
    rows = (~unlimited & ((top_ks <= k) | (top_ks >= vocab))).nonzero().squeeze(1)  # settled by one look, maybe
    values, order = _largest(scaled[rows], k)
    ks, ps = top_ks[rows], top_ps[rows]
    in_top_k = torch.arange(k)[None, :] < ks[:, None]
    # each row's normaliser from its own values (what else is in the batch changes nothing): the whole
    # row's, or its top_k's (at most k: among the values looked at)
    tops, sums = torch.zeros(rows.numel()), torch.zeros(rows.numel())
    whole = ks >= vocab
    if whole.any():
        tops[whole], sums[whole] = _log_normaliser(scaled[rows[whole]])
    if (~whole).any():
        tops[~whole], sums[~whole] = _log_normaliser(values[~whole].masked_fill(~in_top_k[~whole], float("-inf")))
    probs = ((values - tops[:, None]) - sums[:, None]).exp()
    first = torch.arange(k)[None, :] == 0  # (always kept, as in the sorted version)
    in_nucleus = (probs.cumsum(dim=-1) - probs < ps[:, None]) | (ps >= 1.0)[:, None] | first
    kept = in_top_k & torch.isfinite(values) & in_nucleus
    done = ~kept[:, -1] | (ks <= k) | (k == vocab)  # the kept prefix ends among the ranks looked at
    keep[rows[done]] = torch.zeros((int(done.sum()), vocab), dtype=torch.bool).scatter(-1, order[done], kept[done])
    rest = ~unlimited
    rest[rows[done]] = False
    if rest.any():
        keep[rest] = mask_top_k_top_p_sorted(logits[rest], temperatures[rest], top_ks[rest], top_ps[rest]).isfinite()
    return logits.masked_fill(~keep, float("-inf"))


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor | None  # [S] fp32, 0 = greedy (None: all greedy)
    top_ks: torch.Tensor | None  # [S] int64, vocab size when off
    top_ps: torch.Tensor | None  # [S] fp32
    seeds: torch.Tensor | None  # [S] int64
    steps: torch.Tensor | None  # [S] int64, tokens generated so far
    all_greedy: bool
    use_top_k_top_p: bool
    banned_rows: torch.Tensor | None = None  # (rows, token ids) masked to -inf: EOS before min_tokens
    banned_ids: torch.Tensor | None = None
    step_offset: int = 0  # the rows' steps are steps + step_offset (kept parameters: no op on the device)
    min_ps: torch.Tensor | None = None  # [S] fp32 (None: no row has min-p)


def sample(logits: torch.Tensor, sb: SamplingBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] fp32 (16-bit: argmax and Gumbel-max only) -> token ids [S] int64; also written into
    keep[:S] when given (the Gumbel-max kernel writes both: no copy on the step's stream)."""
    if sb.banned_rows is not None:
        logits = logits.index_put((sb.banned_rows, sb.banned_ids), torch.tensor(float("-inf"), device=logits.device))
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        if keep is not None:
            keep[: tokens.shape[0]].copy_(tokens)
        return tokens
    if sb.min_ps is not None:
        logits = mask_min_p_(logits, sb.temperatures, sb.min_ps)
    if sb.use_top_k_top_p:
        logits = mask_top_k_top_p(logits, sb.temperatures, sb.top_ks, sb.top_ps)
    return gumbel_argmax(logits, sb.temperatures, sb.seeds, sb.steps, sb.step_offset, keep)


# ---- sampling from vocabulary shards (tensor parallelism) ------------------------------------------
# The LM head is vocabulary-parallel (layers/embedding.py): rank r holds the logits of token ids
# [r * V/tp, (r + 1) * V/tp). The general path gathers the whole [S, V] logits onto every rank, rank 0
# samples and broadcasts the tokens. Where a step needs only each row's Gumbel-max token (no logprobs,
# top-k/top-p, masks or banned ids), each rank takes the best group score of its own shard and the token
# drawn in that group (a shard is whole groups, and a group's or token's noise is a function of its id,
# so every rank scores its groups as the whole-vocabulary kernel would); the ranks all-gather those
# [2, S] pairs and every rank picks each row's best (ties: the lowest rank, whose ids are the lowest).
# The rows' parameters come from rank 0 in one small broadcast. Rank 0 decides per step
# (samples_from_shards) and the decision travels in the step's inputs, so every rank takes one path.

def samples_from_shards(tp_size: int, samplers: list, scored: list) -> bool:
    """Rank 0: whether a step's samplers need nothing but each row's Gumbel-max token."""
    if tp_size == 1 or scored or not samplers:
        return False
    return all(
        s.structured is None and s.logprobs is None and s.num_top_logprobs == 0 and not s.params.truncates
        and not s.adjusts_logits
        # min_tokens bans stop ids until then; a sequence only gains tokens before its sampling
        and not (s.num_generated < s.params.min_tokens and s.stop_ids)
        for s in samplers
    )


def sampling_parameters(sb: SamplingBatch, num_rows: int, device: torch.device) -> torch.Tensor:
    """Rank 0: the rows' [seeds, steps, temperature bits] as one [3, S] int64 tensor to broadcast."""
    if sb.all_greedy:
        return torch.zeros((3, num_rows), dtype=torch.int64, device=device)
    steps = sb.steps + sb.step_offset if sb.step_offset else sb.steps
    return torch.stack([sb.seeds, steps, sb.temperatures.view(torch.int32).to(torch.int64)])


def tokens_from_shards(tp, logits: torch.Tensor, parameters: torch.Tensor, token_offset: int) -> torch.Tensor:
    """logits [S, V'] fp32: this rank's shard, token ids token_offset + [0, V'); parameters [3, S]
    (sampling_parameters) -> the tokens [S] int64, the same on every rank."""
    seeds, steps, temperature_bits = parameters
    temperatures = temperature_bits.to(torch.int32).view(torch.float32)
    best, ids = gumbel_max(logits, temperatures, seeds, steps, token_offset)
    every = tp.all_gather(torch.stack([best.view(torch.int32).to(torch.int64), ids]))  # [tp, 2, S]
    winner = every[:, 0].to(torch.int32).view(torch.float32).argmax(dim=0)  # the first best rank
    return every[:, 1].gather(0, winner[None]).squeeze(0)


# ---- a step's sampling on rank 0 -------------------------------------------------------------------
class Sampler:
    """Samples the logits of launched steps, and takes the log-probabilities asked for (rank 0; the
    other ranks' part is follow())."""

    def __init__(self, vocab_size: int, staging: Staging, tp, lm_head_start: int):
        self.vocab_size = vocab_size
        self.staging = staging
        self.tp = tp
        self.lm_head_start = lm_head_start  # the first token id of this rank's logits shard
        # where the next decode graph reads its pending input tokens (None: no graphs); every step's
        # sampled tokens are written there
        self.kept_tokens: torch.Tensor | None = None
        self._kept: KeptSampling | None = None  # the last step's parameters (parameters())

    def _stage(self, arrays: list, dtype: torch.dtype) -> list[torch.Tensor]:
        return self.staging.to_device(arrays, dtype)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return self.staging.to_device([values], dtype)[0]

    def parameters(self, seqs: list) -> SamplingBatch:
        """The samplers' parameters on the device. When the same sequences sample as in the step before,
        each one token further, the device tensors of that step are kept and sampled at a step offset
        (an argument of the sampling kernel: no op on the device; a lone sequence's decode is bound by
        the ops between its steps)."""
        params = [s.params for s in seqs]
        banned_rows, banned_ids = [], []
        for i, s in enumerate(seqs):
            if s.num_generated < s.params.min_tokens:
                banned_rows.extend([i] * len(s.stop_ids))
                banned_ids.extend(s.stop_ids)
        banned = self._stage([banned_rows, banned_ids], torch.int64) if banned_rows else (None, None)
        if all(p.greedy for p in params):  # argmax only: no per-row parameters needed
            return SamplingBatch(None, None, None, None, None, True, False, *banned)
        generated = [s.num_generated for s in seqs]
        kept = self._kept
        if not banned_rows and kept is not None and kept.follows(seqs, generated):
            kept.generated = generated
            return dataclasses.replace(kept.batch, step_offset=generated[0] - kept.staged[0])
        top_ks, seeds, steps = self._stage(
            [[p.top_k if p.top_k > 0 else self.vocab_size for p in params], [p.seed or 0 for p in params], generated],
            torch.int64,
        )
        floats = [[p.temperature for p in params], [p.top_p for p in params]]
        if any(p.min_p > 0 for p in params):  # (staged only where a row has min-p)
            floats.append([p.min_p for p in params])
        temperatures, top_ps, *min_ps = self._stage(floats, torch.float32)
        batch = SamplingBatch(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, seeds=seeds, steps=steps, all_greedy=False,
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            banned_rows=banned[0], banned_ids=banned[1], min_ps=min_ps[0] if min_ps else None,
        )
        self._kept = None if banned_rows else KeptSampling(list(seqs), generated, batch)
        return batch

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, samplers: list, scored: list,
               mask: tuple[list[int], torch.Tensor] | None = None, from_shards: bool = False) -> StepOutput:
        """Queue sampling of a launched step's logits [num_logits, V], and the log-probabilities asked
        for; -> its StepOutput, not waited for. scored: (sequence, count, target ids) of the prompt
        tokens scored, whose logits follow the samplers'. mask: (indices of constrained samplers, their
        token bitmask [C, W] int32 on the host), applied to those rows before sampling; log-probabilities
        are the model's, taken before it. from_shards: logits are this rank's shard (samples_from_shards)."""
        num_sampled = len(samplers)
        outputs = []  # fp32 values read back: sampled tokens' logprobs, then prompt logprobs
        tokens = top = None
        wanting = []
        if samplers:
            lp_rows, lp = self._logprob_rows(logits, samplers)  # (before the mask changes the logits)
            wanting = [i for i in lp_rows if samplers[i].logprobs is not None]
            if wanting:
                wanted_lp = self._lp_of(lp_rows, lp, wanting)
            top = self._top_logprobs(lp_rows, lp, samplers)
            if mask is not None:
                rows, bitmask = mask
                if logits.is_cuda:
                    bitmask = bitmask.to(logits.device, non_blocking=True)
                apply_token_bitmask(logits, bitmask, self._tensor(rows, torch.int64))
            if any(s.adjusts_logits for s in samplers):  # (penalized samplers' tokens are all read back)
                apply_allowed_and_bias(logits, samplers, self._stage)
                apply_bad_words(logits, samplers, self._stage)
                apply_penalties(logits, samplers, self._stage)
            if from_shards:  # (nothing above applies: samples_from_shards)
                parameters = sampling_parameters(self.parameters(samplers), num_sampled, logits.device)
                tokens = tokens_from_shards(self.tp, logits, self.tp.broadcast(parameters), self.lm_head_start)
                self._keep(tokens)
            else:  # (the sampler keeps the tokens for the next decode graph itself)
                tokens = sample(logits[:num_sampled], self.parameters(samplers), self.kept_tokens)
                self.tp.broadcast(tokens)  # the other ranks' next step may take input tokens from them
            if wanting:
                wanted_tokens = tokens if len(wanting) == len(samplers) else tokens[self._tensor(wanting, torch.int64)]
                outputs.append(wanted_lp.gather(1, wanted_tokens[:, None]).squeeze(1))
        if scored:
            targets = self._tensor([t for _, _, ids in scored for t in ids], torch.int64)
            lp = torch.log_softmax(logits[num_sampled:], dim=-1)
            outputs.append(lp.gather(1, targets[:, None]).squeeze(1))
        return StepOutput(samplers, wanting, [(seq, count) for seq, count, _ in scored], tokens,
                          torch.cat(outputs) if outputs else None, self.staging, top)

    @torch.inference_mode()
    def follow(self, logits: torch.Tensor, num_sampled: int, from_shards: bool) -> torch.Tensor:
        """A rank other than 0: the step's sampled tokens [S], rank 0's (broadcast on the device) or
        taken from every rank's shard, kept for the next step's pending input tokens."""
        if from_shards:
            parameters = self.tp.broadcast(torch.empty((3, num_sampled), dtype=torch.int64, device=logits.device))
            tokens = tokens_from_shards(self.tp, logits, parameters, self.lm_head_start)
        else:
            tokens = self.tp.broadcast(torch.empty(num_sampled, dtype=torch.int64, device=logits.device))
        self._keep(tokens)
        return tokens

    def _keep(self, tokens: torch.Tensor) -> None:
        """A step's sampled tokens into kept_tokens (where the sampler did not write them itself)."""
        if self.kept_tokens is not None:
            self.kept_tokens[: tokens.shape[0]].copy_(tokens)

    def _logprob_rows(self, logits: torch.Tensor, samplers: list):
        """The log-softmax of the samplers that asked for logprobs or top_logprobs, taken once ->
        (their indices, [R, V] fp32 on the device), or ([], None)."""
        rows = [i for i, s in enumerate(samplers) if s.logprobs is not None or s.num_top_logprobs > 0]
        if not rows:
            return rows, None
        # every sampler asking (an OpenAI job with logprobs): no [S, V] gather
        picked = logits[: len(samplers)] if len(rows) == len(samplers) else logits[self._tensor(rows, torch.int64)]
        return rows, torch.log_softmax(picked, dim=-1)

    def _lp_of(self, lp_rows: list[int], lp: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The rows of lp (taken for the samplers lp_rows) of the samplers `indices`, a subsequence."""
        if len(indices) == len(lp_rows):
            return lp
        position = {row: j for j, row in enumerate(lp_rows)}
        return lp[self._tensor([position[i] for i in indices], torch.int64)]

    def _top_logprobs(self, lp_rows: list[int], lp: torch.Tensor | None, samplers: list):
        """-> (indices of samplers that asked for top_logprobs, their k, ids [T, k_max] int64,
        logprobs [T, k_max] fp32) on the device, or None when none asked."""
        asking = [i for i in lp_rows if samplers[i].num_top_logprobs > 0]
        if not asking:
            return None
        ks = [samplers[i].num_top_logprobs for i in asking]
        values, ids = self._lp_of(lp_rows, lp, asking).topk(max(ks), dim=-1)
        return asking, ks, ids, values


class KeptSampling:
    """A step's sampling parameters on the device, and the sequences and token counts they were made for."""

    def __init__(self, seqs: list, generated: list[int], batch: SamplingBatch):
        self.seqs, self.generated, self.batch = seqs, generated, batch
        self.staged = generated  # the counts batch.steps holds: a later step samples at an offset

    def follows(self, seqs: list, generated: list[int]) -> bool:
        """Whether seqs are these sequences, in this order, each with one token more."""
        return (len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs))
                and all(g == h + 1 for g, h in zip(generated, self.generated)))


class StepOutput:
    """The results of a launched step, copied back to the host as the device produces them."""

    def __init__(self, samplers, wanting, scored, tokens, values, staging: Staging, top=None):
        self.samplers = samplers  # sequences that sampled, in the order of `tokens`
        self.wanting = wanting  # indices of samplers that asked for their token's logprob
        self.scored = scored  # (sequence, number of prompt logprobs), in the order of `values`
        self.tokens = tokens  # [S] int64 on the device, or None
        results = [t for t in (tokens, values) if t is not None]
        # top_logprobs: (sampler indices, their k, ids [T, k_max], logprobs [T, k_max]); all copied back at once
        hosts, self._event = staging.to_host(results + ([] if top is None else list(top[2:])))  # (event: None on CPU)
        self._host = hosts[: len(results)]
        self._top = None if top is None else (top[0], top[1], *hosts[len(results):])
        self.top_logprobs: list[tuple[int, list[tuple[int, float]]]] = []  # set by read()

    def read(self, check: Callable[[], None] | None = None) -> tuple[list[int], list[float], list[float]]:
        """Wait for the step -> (sampled tokens, their logprobs for `wanting`, prompt logprobs).
        check: called while waiting, to raise if another tensor-parallel rank died (its collectives
        would keep this step from ever finishing)."""
        if self._event is not None:
            if check is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    check()
                    time.sleep(1e-4)
        host = [t.tolist() for t in self._host]
        if self._top is not None:
            asking, ks, ids, values = self._top
            self.top_logprobs = [
                (i, list(zip(row_ids[:k], row_values[:k])))
                for i, k, row_ids, row_values in zip(asking, ks, ids.tolist(), values.tolist())
            ]
        tokens = host.pop(0) if self.tokens is not None else []
        values = host.pop(0) if host else []
        split = len(self.wanting)
        return tokens, values[:split], values[split:]
