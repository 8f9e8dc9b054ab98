"""Sampling of one token per row by the Gumbel-max trick in two levels, with counter-based noise:

    x_v = logits[v] / T,  groups of GROUP consecutive token ids,  Z_g = sum_{v in g} exp(x_v)
    group = argmax_g (ln Z_g + n_g),        token = argmax_{v in group} (x_v + n_v)
    n = -ln(-ln u),  u = hash(seed, step, id): id = the token id, or 2^31 + g for group g
    (T = 0: token = argmax_v logits[v], the first)

P(group g) = Z_g / Z and P(v | g) = exp(x_v) / Z_g, so P(v) is the softmax of x, with noise made once
a group and for the chosen group's tokens only. u is a pure function of (seed, step, id) (a 32-bit
integer mix, 23 bits into (0, 1)), so a row's sample never depends on the other rows, and a request
recomputed after preemption draws the same tokens. A vocabulary shard under tensor parallelism is
whole groups (layers/embedding.py). The kernel's logs are approximate (lg2.approx, ex2.approx): a
token can differ from the reference's only on a near-tie.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchgen.kernels.device import interpreting, pdl_launch_args, wait_for_prior_kernels

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # multiplier of both mix rounds
_TOKEN_SALT = 0x9E3779B9  # added to token ids before mixing


@triton.jit
def _hash32(x):
    """x: uint32 -> uint32 (products wrap mod 2^32, as the reference's `& 0xFFFFFFFF`)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


_NEG_LN2 = tl.constexpr(-0.6931471805599453)  # (tensor * constexpr: a constexpr first is not a tensor op)
_SALT = tl.constexpr(_TOKEN_SALT)
# lg2.approx is a GPU instruction; the CPU interpreter (tests) has no libdevice and takes the exact log2
_APPROX_LOG2 = tl.constexpr(not interpreting())


@triton.jit
def _log2_approx(x):
    """lg2.approx on a GPU; the exact log2 under the CPU interpreter."""
    if _APPROX_LOG2:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _gumbel_noise(bits):
    """bits: 23 random bits (uint32) -> g = -ln(-ln u), u = (bits + 0.5) / 2^23, fp32.

    u: the bits as the mantissa of 1 + bits / 2^23, minus 1 - 2^-24 (both exact; an int-to-float
    conversion runs at a quarter of the FMA rate). The exact log2 (libdevice's log2f, ~20 instructions)
    twice an element was half the kernel's time; lg2.approx (one instruction) is within 2^-22 of log2 on
    [0.5, 2] and 2 ulp elsewhere. That is fine for the outer log and for -ln u where u <= 7/8, but as
    u -> 1 the approximate -ln u loses all its digits, and that is where the largest noises, the winning
    ones, come from. There w = 1 - u < 1/8 (exact, u >= 1/2) and -ln u = -ln(1 - w) = w + w^2/2 + ... +
    w^8/8 (the rest is below 2^-24 of it). Error of g: < 3e-6 (the exact log2 twice: a few fp32 ulps)."""
    u = (bits | 0x3F800000).to(tl.float32, bitcast=True) - 0.999999940395355224609375  # 1 - 2^-24
    w = 1.0 - u
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3 + w * (0.25 + w * (0.2 + w * (1.0 / 6 + w * (1.0 / 7 + w * 0.125)))))))
    neg_ln_u = tl.where(w < 0.125, series, _log2_approx(u) * _NEG_LN2)
    return _log2_approx(neg_ln_u) * _NEG_LN2


GROUP = 8  # token ids a group: 8 consecutive values of a row are one thread's (no exchange between threads)
_GROUP_SALT = tl.constexpr((_TOKEN_SALT + (1 << 31)) & _M32)  # a group's id, 2^31 + g, salted as a token's
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _noise_bits(key, salted_id):
    """A row's key and a salted id (uint32) -> the 23 random bits of that id's noise (_uniform_at on the host)."""
    return _hash32(key ^ _hash32(salted_id)) >> 9


@triton.jit
def _row_key(seed, step):
    """seed, step: int64 -> the row's 32-bit key (_row_keys on the host)."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _hash32(seed_lo ^ _hash32(seed_hi ^ _hash32((step & 0xFFFFFFFF).to(tl.uint32))))


# The part count and size change with the number of rows: not specialized (a value divisible by 16,
# or 1, would be another compile in the middle of a job); nor the rows' parameters on alignment (kernels/__init__.py).
@triton.jit(do_not_specialize=["num_rows", "blocks_per_part", "num_parts", "token_offset", "step_offset"],
            do_not_specialize_on_alignment=["temperatures_ptr", "seeds_ptr", "steps_ptr"])
def _best_group_parts_kernel(
    logits_ptr,  # [S, V] fp32, or 16-bit (a step that only samples its logits: executor/model_runner.py)
    logits_stride,  # elements between two rows of logits
    temperatures_ptr,  # [S] fp32, 0 = greedy
    seeds_ptr,  # [S] int64
    steps_ptr,  # [S] int64
    step_offset,  # added to every row's step (kept sampling parameters: executor/model_runner.py)
    part_max_ptr,  # [S, P] fp32: the best group score of each part of a row
    part_arg_ptr,  # [S, P] int32: that group (its index in this shard)
    num_rows,  # S
    vocab,  # V
    blocks_per_part,  # BLOCK-sized blocks of the vocabulary a part
    num_parts,  # P
    token_offset,  # the token id of column 0 (a tensor-parallel rank's shard: whole groups)
    ROWS: tl.constexpr,  # rows a program: a group's id is hashed once for all of them
    GROUPS: tl.constexpr,  # groups an iteration
    GROUP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    """Score of group g: ln Z_g + n_g for a sampled row (Z_g = sum 2^(y - top) * 2^top, y = x log2(e) / T,
    in log2 units until the end); the largest logit of the group for a greedy row."""
    wait_for_prior_kernels(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows = tl.where(row_ok, rows, 0).to(tl.int64)  # (rows past S read row 0's parameters, store nothing)
    temperature = tl.load(temperatures_ptr + rows)
    key = _row_key(tl.load(seeds_ptr + rows), tl.load(steps_ptr + rows) + step_offset)[:, None]  # [ROWS, 1]
    noisy = (temperature > 0)[:, None]
    scale = tl.where(temperature > 0, _LOG2E / tl.where(temperature > 0, temperature, 1.0), 1.0)[:, None, None]
    salted_offset = (token_offset // GROUP).to(tl.uint32) + _GROUP_SALT  # (id + salt mod 2^32, as the reference's)
    BLOCK: tl.constexpr = GROUPS * GROUP
    within = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    # a running best per (row, group lane), reduced once at the end
    best_val = tl.full([ROWS, GROUPS], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([ROWS, GROUPS], dtype=tl.int32)
    first = tl.program_id(1) * blocks_per_part
    # block * BLOCK, not a range stepping by BLOCK from a runtime start: so the compiler knows a group's
    # values are contiguous and aligned and gives each thread whole groups, loaded as one vector (from
    # a runtime start it spread every group over 32 threads, each making the group's noise: 4x slower)
    for block in range(first, tl.minimum(first + blocks_per_part, tl.cdiv(vocab, BLOCK))):
        idx = block * BLOCK + within
        in_vocab = idx < vocab
        x = tl.load(logits_ptr + rows[:, None, None] * logits_stride + idx[None, :, :],
                    mask=row_ok[:, None, None] & in_vocab[None, :, :], other=float("-inf")).to(tl.float32)
        y = x * scale
        top = tl.max(y, axis=2)  # [ROWS, GROUPS]
        top_finite = tl.where(tl.abs(top) < float("inf"), top, 0.0)  # (+-inf, a masked group: no inf - inf)
        mass = tl.sum(tl.exp2(y - top_finite[:, :, None]), axis=2)
        log2_mass = tl.where(mass > 0, top_finite + tl.log2(tl.where(mass > 0, mass, 1.0)), float("-inf"))
        group = block * GROUPS + tl.arange(0, GROUPS)
        # (a group's id hashed once for its rows)
        bits = _noise_bits(key, (group.to(tl.uint32) + salted_offset)[None, :])
        score = tl.where(noisy, log2_mass * _LN2 + _gumbel_noise(bits), top)
        better = score > best_val  # strict: a lane keeps its first maximum
        best_idx = tl.where(better, group[None, :], best_idx)
        best_val = tl.where(better, score, best_val)
    top = tl.max(best_val, axis=1)
    # the smallest group among the lanes at the maximum: the first maximum, as torch.argmax
    # (only -inf scores: group 0)
    best_idx = tl.min(tl.where(best_val == top[:, None], best_idx, 2147483647), axis=1)
    part = tl.program_id(1)
    tl.store(part_max_ptr + rows * num_parts + part, top, mask=row_ok)
    tl.store(part_arg_ptr + rows * num_parts + part, best_idx, mask=row_ok)


@triton.jit(do_not_specialize=["num_parts", "token_offset", "step_offset"],
            do_not_specialize_on_alignment=["temperatures_ptr", "seeds_ptr", "steps_ptr"])
def _token_of_best_group_kernel(
    logits_ptr, logits_stride, temperatures_ptr, seeds_ptr, steps_ptr, step_offset,  # as above
    part_max_ptr,  # [S, P] fp32
    part_arg_ptr,  # [S, P] int32
    out_ptr,  # [S] int64 chosen token ids
    best_ptr,  # [S] fp32 their groups' scores (WRITE_BEST)
    keep_ptr,  # [>= S] int64: the token ids once more (KEEP)
    vocab,
    num_parts,  # P
    token_offset,
    PARTS: tl.constexpr,  # MAX_PARTS, whatever P (one compile)
    GROUP: tl.constexpr,
    WRITE_BEST: tl.constexpr,
    KEEP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    """A row's first best part -> its group -> the token: argmax of x_v / T + n_v over the group
    (of the logits for a greedy row), the first at the maximum."""
    wait_for_prior_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PARTS)
    best = tl.load(part_max_ptr + row * num_parts + offs, mask=offs < num_parts, other=float("-inf"))
    part = tl.argmax(best, axis=0, tie_break_left=True)  # parts are in token order: the first maximum
    idx = tl.load(part_arg_ptr + row * num_parts + part) * GROUP + tl.arange(0, GROUP)
    x = tl.load(logits_ptr + row * logits_stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row) + step_offset)
    bits = _noise_bits(key, idx.to(tl.uint32) + (token_offset.to(tl.uint32) + _SALT))
    score = tl.where(temperature > 0, x / tl.where(temperature > 0, temperature, 1.0) + _gumbel_noise(bits), x)
    score = tl.where(idx < vocab, score, float("-inf"))
    pick = tl.argmax(score, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(tl.arange(0, GROUP) == pick, idx, 0)).to(tl.int64) + token_offset
    tl.store(out_ptr + row, token)
    if KEEP:
        tl.store(keep_ptr + row, token)
    if WRITE_BEST:
        tl.store(best_ptr + row, tl.load(part_max_ptr + row * num_parts + part))


# 2 rows of 64 groups a program (the fastest of those tried)
ROWS = 2
GROUPS = 64
BLOCK = GROUPS * GROUP
PROGRAMS = 1024  # enough programs to fill an H100/H200 (132 SMs) several times over
MAX_PARTS = 128


def gumbel_argmax_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    parts: int | None = None, step_offset: int = 0, keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's vocabulary is cut into `parts` (default: about PROGRAMS programs of ROWS rows each, 8
    parts at 256 rows, 126 for a single row of a 128k vocabulary); each part's best group, then the
    first best part's group and its token. The token does not depend on the number of parts. The rows'
    steps are steps + step_offset; keep [>= S] int64, when given, receives the tokens too (from the
    same kernel: no copy after it)."""
    return _launch(logits, temperatures, seeds, steps, parts, 0, False, step_offset, keep)[1]


def gumbel_max_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard of the vocabulary: logits [S, V'] are the scores of token ids token_offset + [0, V'),
    token_offset a multiple of GROUP. -> each row's best group score [S] fp32 (ln Z_g plus its noise;
    the largest logit for a greedy row) and the token drawn in that group [S] int64. The shards' best
    scores compared (ties to the lowest id) give gumbel_argmax_triton's token over the whole
    vocabulary: the noise of a group or token depends on its id, not on its column."""
    return _launch(logits, temperatures, seeds, steps, parts, token_offset, want_best=True)


def _launch(logits, temperatures, seeds, steps, parts, token_offset, want_best, step_offset=0, keep=None):
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    assert token_offset % GROUP == 0, "a vocabulary shard must start at a group"
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    best = torch.empty(rows if want_best else 0, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return best, out
    if vocab == 0:  # (a rank whose shard is all padding): never chosen
        assert keep is None
        return best.fill_(float("-inf")), out.fill_(token_offset)
    blocks = triton.cdiv(vocab, BLOCK)
    row_blocks = triton.cdiv(rows, ROWS)
    parts = min(blocks, MAX_PARTS, parts or triton.cdiv(PROGRAMS, row_blocks))
    blocks_per_part = triton.cdiv(blocks, parts)
    parts = triton.cdiv(blocks, blocks_per_part)  # (no empty part)
    part_max = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    part_arg = torch.empty((rows, parts), dtype=torch.int32, device=logits.device)
    pdl = pdl_launch_args(logits.device)
    _best_group_parts_kernel[(row_blocks, parts)](
        logits, logits.stride(0), temperatures, seeds, steps, step_offset, part_max, part_arg,
        rows, vocab, blocks_per_part, parts, token_offset, ROWS=ROWS, GROUPS=GROUPS, GROUP=GROUP, num_warps=4, **pdl,
    )
    if keep is not None:
        assert keep.dtype == torch.int64 and keep.device == logits.device and keep.numel() >= rows
    _token_of_best_group_kernel[(rows,)](
        logits, logits.stride(0), temperatures, seeds, steps, step_offset, part_max, part_arg, out,
        best if want_best else part_max, out if keep is None else keep, vocab, parts, token_offset,
        PARTS=MAX_PARTS, GROUP=GROUP, WRITE_BEST=want_best, KEEP=keep is not None, **pdl,
    )
    return best, out


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's mix on int64 tensors holding values < 2^32 (products stay < 2^63)."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[S] int64 seeds and steps -> each row's key, as the kernel mixes it."""
    return hash32((seeds & _M32) ^ hash32(((seeds >> 32) & _M32) ^ hash32(steps & _M32)))


def _uniform_at(row_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), fp32, of the rows' keys at these ids (broadcast; token ids, or 2^31 + a group's
    index): 23 random bits + 0.5."""
    bits = hash32(row_keys ^ hash32((ids + _TOKEN_SALT) & _M32)) >> 9
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


def temperature_scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits [S, V] / temperatures [S]; greedy rows (temperature 0) as they are."""
    return logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def _scaled_groups(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> their scaled values in fp32 (as the kernel reads 16-bit logits), [S, ceil(V /
    GROUP), GROUP], the tail padded with -inf."""
    x = temperature_scaled(logits.float(), temperatures)
    groups = -(-x.shape[-1] // GROUP)
    if groups * GROUP != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, groups * GROUP - x.shape[-1]), value=float("-inf"))
    return x.reshape(x.shape[0], groups, GROUP)


def _group_scores(
    grouped: torch.Tensor, row_keys: torch.Tensor, groups: torch.Tensor, token_offset: int
) -> torch.Tensor:
    """ln Z_g + n_g of these groups (grouped [K, GROUP] scaled logits, groups [K] their indices in the
    shard, row_keys [K])."""
    ids = (1 << 31) + token_offset // GROUP + groups
    return torch.logsumexp(grouped, dim=-1) + _gumbel(_uniform_at(row_keys, ids))


def _token_in_group(grouped: torch.Tensor, noisy: torch.Tensor, row_keys: torch.Tensor, group: torch.Tensor,
                    token_offset: int) -> torch.Tensor:
    """grouped [S, n, GROUP] (scaled logits; the logits of greedy rows), each row's chosen group [S] ->
    its token id: argmax of x_v + n_v (of the logits where greedy) over the group, the first."""
    values = grouped[torch.arange(grouped.shape[0], device=grouped.device), group]  # [S, GROUP]
    ids = group[:, None] * GROUP + torch.arange(GROUP, device=grouped.device)
    scores = torch.where(noisy[:, None], values + _gumbel(_uniform_at(row_keys[:, None], ids + token_offset)), values)
    return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1) + token_offset


def gumbel_argmax_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    return gumbel_max_ref(logits, temperatures, seeds, steps, 0)[1]


def gumbel_max_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_max_triton's reference (and the CPU's path where a row has nothing finite): a shard's best
    group scores [S] fp32 and the tokens drawn in those groups [S] int64, every group scored."""
    rows, vocab = logits.shape
    if vocab == 0:
        return (torch.full((rows,), float("-inf"), device=logits.device),
                torch.full((rows,), token_offset, dtype=torch.int64, device=logits.device))
    noisy = temperatures > 0
    grouped = _scaled_groups(logits, temperatures)
    keys = _row_keys(seeds, steps)
    groups = torch.arange(grouped.shape[1], device=logits.device)
    scores = torch.where(noisy[:, None], _group_scores(grouped, keys[:, None], groups[None, :], token_offset),
                         grouped.amax(dim=-1))
    group = scores.argmax(dim=-1)  # the first maximum
    return scores.gather(1, group[:, None]).squeeze(1), _token_in_group(grouped, noisy, keys, group, token_offset)


# u is in [0.5, 2^23 - 0.5] / 2^23, so every noise value lies in [n(u_min), n(u_max)] (-2.8, 16.6), and a
# group's ln Z_g in [top_g, top_g + ln GROUP] (top_g its largest scaled logit). So the row's best score is
# at least its largest top_g + n(u_min), and a group whose top_g is more than the noise's span + ln GROUP
# (and a margin for rounding) below the row's largest can never be the row's best.
_GROUP_SPAN = (_gumbel(torch.tensor((2**23 - 0.5) / 2**23)) - _gumbel(torch.tensor(0.5 / 2**23))).item() \
    + math.log(GROUP) + 1.0


def gumbel_argmax_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """gumbel_argmax_ref's tokens, the groups' masses and noise made only for the groups that can win
    (those within _GROUP_SPAN of their row's best): the exponentials of the whole [S, V] were most of
    a CPU job's sampling time. The same values, group by group, as the reference's."""
    return gumbel_max_cpu(logits, temperatures, seeds, steps, 0)[1]


def gumbel_max_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_max_ref's scores and tokens for a shard of the vocabulary (ids token_offset + [0, V')),
    only the groups that can win scored (gumbel_argmax_cpu)."""
    assert token_offset % GROUP == 0, "a vocabulary shard must start at a group"
    noisy = temperatures > 0
    if logits.shape[-1] == 0 or not noisy.any():
        return gumbel_max_ref(logits, temperatures, seeds, steps, token_offset)
    grouped = _scaled_groups(logits, temperatures)
    tops = grouped.amax(dim=-1)  # [S, n]
    best_top = tops.amax(dim=-1)
    if not torch.isfinite(best_top[noisy]).all():  # NaN, inf or all masked: as the reference does
        return gumbel_max_ref(logits, temperatures, seeds, steps, token_offset)
    keys = _row_keys(seeds, steps)
    rows, cols = ((tops >= (best_top - _GROUP_SPAN)[:, None]) & noisy[:, None]).nonzero(as_tuple=True)
    scores = _group_scores(grouped[rows, cols], keys[rows], cols, token_offset)
    best = torch.full_like(best_top, float("-inf")).scatter_reduce(0, rows, scores, "amax")
    best = torch.where(noisy, best, best_top)
    at_best = scores == best[rows]  # the first group at the row's maximum, as argmax takes it
    first = torch.full_like(seeds, grouped.shape[1]).scatter_reduce(0, rows[at_best], cols[at_best], "amin")
    group = torch.where(noisy, first, tops.argmax(dim=-1))  # greedy rows: the group of the first largest logit
    return best, _token_in_group(grouped, noisy, keys, group, token_offset)


def gumbel_argmax(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    step_offset: int = 0, keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [S, V] fp32, or 16-bit on a GPU (-inf where masked); temperatures [S] fp32; seeds, steps
    [S] int64 -> token ids [S] int64, drawn at steps + step_offset; also into keep[:S] when given."""
    if logits.is_cuda:
        return gumbel_argmax_triton(logits, temperatures, seeds, steps, step_offset=step_offset, keep=keep)
    tokens = gumbel_argmax_cpu(logits, temperatures, seeds, steps + step_offset if step_offset else steps)
    if keep is not None:
        keep[: tokens.shape[0]].copy_(tokens)
    return tokens


def gumbel_max(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard of the vocabulary (gumbel_max_triton) -> each row's best score [S] fp32 and token id [S]."""
    if logits.is_cuda:
        return gumbel_max_triton(logits, temperatures, seeds, steps, token_offset)
    return gumbel_max_cpu(logits, temperatures, seeds, steps, token_offset)
