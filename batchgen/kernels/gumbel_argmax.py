"""Sampling of one token per row by the Gumbel-max trick, with counter-based noise:

    token = argmax_v(logits[v] / T + g_v),   g_v = -log(-log(u_v)),   u_v = hash(seed, step, v)
    (T = 0: token = argmax_v(logits[v]))

u is a pure function of (seed, step, token id), so a row's sample never depends on the other rows
of the batch, and a request recomputed after preemption draws the same tokens. The hash is a 32-bit
integer mix (two multiply-xorshift rounds); 23 of its bits make u in (0, 1): with 24, bits + 0.5
rounded to 2^24 in fp32 for the top half-unit, u was 1 and g = +inf for about one token in 2^24 of
every row (a 128k vocabulary: one sample in 130 was a uniformly random token; a masked token's
-inf + inf = NaN won torch's argmax). The Triton kernels read each row of logits once: programs over
(4 rows, part of the vocabulary), each a running max per lane over its blocks, then one program per row
takes the first best part (a single row of a 128k vocabulary in one program took 97 us on an H200, 256
rows in 256 programs 157 us; with the parts 142 us, 69-103 us with _gumbel_noise's approximate logs, and
58 us with 4 rows a program, which hash each token id once for the 4).
The reference builds the [S, V] noise with int64 torch ops and exact logs; the kernel's noise is within
3e-6 of it, so a token can differ from the reference's only on a near-tie.
"""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchgen.kernels.pdl import pdl_launch_args, wait_for_prior_kernels

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
_APPROX_LOG2 = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


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


# The part count and size change with the number of rows: not specialized (a value divisible by 16,
# or 1, would be another compile in the middle of a job); nor the rows' parameters on alignment (kernels/__init__.py).
@triton.jit(do_not_specialize=["num_rows", "part_size", "num_parts", "token_offset", "step_offset"],
            do_not_specialize_on_alignment=["temperatures_ptr", "seeds_ptr", "steps_ptr"])
def _gumbel_argmax_parts_kernel(
    logits_ptr,  # [S, V] fp32, or 16-bit (a step that only samples its logits: engine/runner.py)
    logits_stride,  # elements between two rows of logits
    temperatures_ptr,  # [S] fp32, 0 = greedy
    seeds_ptr,  # [S] int64
    steps_ptr,  # [S] int64
    step_offset,  # added to every row's step (kept sampling parameters: engine/runner.py)
    part_max_ptr,  # [S, P] fp32: the best score of each part of a row
    part_arg_ptr,  # [S, P] int64: its token id
    num_rows,  # S
    vocab,  # V
    part_size,  # vocabulary entries per part, a multiple of BLOCK
    num_parts,  # P
    token_offset,  # the token id of column 0 (a tensor-parallel rank's shard of the vocabulary)
    ROWS: tl.constexpr,  # rows a program: the token ids' own hash is made once for all of them
    BLOCK: tl.constexpr,  # vocabulary entries per iteration
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    wait_for_prior_kernels(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows = tl.where(row_ok, rows, 0).to(tl.int64)  # (rows past S read row 0's parameters, store nothing)
    part = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + rows)
    seed = tl.load(seeds_ptr + rows)
    step = tl.load(steps_ptr + rows) + step_offset
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _hash32(seed_lo ^ _hash32(seed_hi ^ _hash32((step & 0xFFFFFFFF).to(tl.uint32))))[:, None]  # [ROWS, 1]
    noisy = (temperature > 0)[:, None]
    inv_t = (1.0 / tl.where(temperature > 0, temperature, 1.0))[:, None]
    # token id + salt mod 2^32 in uint32 arithmetic, as the reference's (id + salt) & 0xFFFFFFFF
    salted_offset = token_offset.to(tl.uint32) + _SALT
    # a running best per lane, reduced once at the end (a block reduction per iteration cost ~3x)
    best_val = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    first = part * part_size
    for start in range(first, tl.minimum(first + part_size, vocab), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < vocab
        x = tl.load(logits_ptr + rows[:, None] * logits_stride + idx[None, :], mask=row_ok[:, None] & mask[None, :],
                    other=float("-inf")).to(tl.float32)
        token_hash = _hash32(idx.to(tl.uint32) + salted_offset)[None, :]  # [1, BLOCK]: one for all ROWS rows
        bits = _hash32(key ^ token_hash) >> 9  # 23 bits: u < 1
        score = tl.where(noisy, x * inv_t + _gumbel_noise(bits), x)
        score = tl.where(mask[None, :], score, float("-inf"))
        better = score > best_val  # strict: a lane keeps its first maximum
        best_idx = tl.where(better, idx[None, :], best_idx)
        best_val = tl.where(better, score, best_val)
    top = tl.max(best_val, axis=1)
    # the smallest token id among the lanes at the maximum: the first maximum, as torch.argmax
    # (only -inf scores: token 0, as before the parts)
    best_idx = tl.min(tl.where(best_val == top[:, None], best_idx, 2147483647), axis=1)
    tl.store(part_max_ptr + rows * num_parts + part, top, mask=row_ok)
    tl.store(part_arg_ptr + rows * num_parts + part, best_idx.to(tl.int64) + token_offset, mask=row_ok)


@triton.jit(do_not_specialize=["num_parts"])
def _argmax_of_parts_kernel(
    part_max_ptr,  # [S, P] fp32
    part_arg_ptr,  # [S, P] int64
    out_ptr,  # [S] int64 chosen token ids
    best_ptr,  # [S] fp32 their scores (WRITE_BEST)
    keep_ptr,  # [>= S] int64: the token ids once more (KEEP)
    num_parts,  # P
    PARTS: tl.constexpr,  # MAX_PARTS, whatever P (one compile)
    WRITE_BEST: tl.constexpr,
    KEEP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    wait_for_prior_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PARTS)
    best = tl.load(part_max_ptr + row * num_parts + offs, mask=offs < num_parts, other=float("-inf"))
    part = tl.argmax(best, axis=0, tie_break_left=True)  # parts are in token order: the first maximum
    token = tl.load(part_arg_ptr + row * num_parts + part)
    tl.store(out_ptr + row, token)
    if KEEP:
        tl.store(keep_ptr + row, token)
    if WRITE_BEST:
        tl.store(best_ptr + row, tl.load(part_max_ptr + row * num_parts + part))


# 4 rows of 512 entries a program: 58 us at 256 rows of a 128k vocabulary (H200, benchmarks/KERNELS.md)
# against 69-103 us for a row of 1,024 a program, which made each token's own hash once a row
ROWS = 4
BLOCK = 512
PROGRAMS = 1024  # enough programs to fill an H100/H200 (132 SMs) several times over
MAX_PARTS = 128


def gumbel_argmax_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    parts: int | None = None, step_offset: int = 0, keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's vocabulary is cut into `parts` (default: about PROGRAMS programs of ROWS rows each, 16
    parts at 256 rows, 128 for a single row of a 128k vocabulary); each part's best score and token, then
    the first best part of each row. The token does not depend on the number of parts. The rows'
    steps are steps + step_offset; keep [>= S] int64, when given, receives the tokens too (from the
    same kernel: no copy after it)."""
    return _launch(logits, temperatures, seeds, steps, parts, 0, False, step_offset, keep)[1]


def gumbel_max_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard of the vocabulary: logits [S, V'] are the scores of token ids token_offset + [0, V').
    -> each row's best score [S] fp32 (the scaled logit plus its noise; the logit for a greedy row)
    and its token id [S] int64, the first at that score. The shards' best scores compared (ties to
    the lowest id) give gumbel_argmax_triton's token over the whole vocabulary: the noise of a token
    depends on its id, not on its column."""
    return _launch(logits, temperatures, seeds, steps, parts, token_offset, want_best=True)


def _launch(logits, temperatures, seeds, steps, parts, token_offset, want_best, step_offset=0, keep=None):
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
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
    part_size = triton.cdiv(blocks, parts) * BLOCK
    parts = triton.cdiv(vocab, part_size)  # (no empty part)
    part_max = torch.empty((rows, parts), dtype=torch.float32, device=logits.device)
    part_arg = torch.empty((rows, parts), dtype=torch.int64, device=logits.device)
    pdl = pdl_launch_args(logits.device)
    _gumbel_argmax_parts_kernel[(row_blocks, parts)](
        logits, logits.stride(0), temperatures, seeds, steps, step_offset, part_max, part_arg,
        rows, vocab, part_size, parts, token_offset, ROWS=ROWS, BLOCK=BLOCK, num_warps=4, **pdl,
    )
    if keep is not None:
        assert keep.dtype == torch.int64 and keep.device == logits.device and keep.numel() >= rows
    _argmax_of_parts_kernel[(rows,)](part_max, part_arg, out, best if want_best else part_max,
                                     out if keep is None else keep, parts,
                                     PARTS=MAX_PARTS, WRITE_BEST=want_best, KEEP=keep is not None, **pdl)
    return best, out


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's mix on int64 tensors holding values < 2^32 (products stay < 2^63)."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[S] int64 seeds and steps -> each row's key, as the kernel mixes it."""
    return hash32((seeds & _M32) ^ hash32(((seeds >> 32) & _M32) ^ hash32(steps & _M32)))


def _uniform_at(row_keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), fp32, of the rows' keys at these token ids (broadcast): 23 random bits + 0.5."""
    bits = hash32(row_keys ^ hash32(token_ids + _TOKEN_SALT)) >> 9
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), [S, V] fp32, a pure function of (seed, step, token id)."""
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return _uniform_at(_row_keys(seeds, steps)[:, None], token_ids[None, :])


def temperature_scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits [S, V] / temperatures [S]; greedy rows (temperature 0) as they are."""
    return logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]


def gumbel_argmax_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    noisy = temperatures > 0
    scores = temperature_scaled(logits, temperatures) + _gumbel(uniform_noise(seeds, steps, logits.shape[-1]))
    return torch.where(noisy, scores.argmax(dim=-1), logits.argmax(dim=-1))


def gumbel_max_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_max_triton's reference (and the CPU's path): a shard's best scores [S] fp32 and their
    token ids [S] int64, scored as gumbel_argmax_ref scores the whole vocabulary."""
    rows, vocab = logits.shape
    if vocab == 0:
        return (torch.full((rows,), float("-inf"), device=logits.device),
                torch.full((rows,), token_offset, dtype=torch.int64, device=logits.device))
    token_ids = torch.arange(token_offset, token_offset + vocab, device=logits.device, dtype=torch.int64)
    noise = _gumbel(_uniform_at(_row_keys(seeds, steps)[:, None], token_ids[None, :]))
    scores = torch.where((temperatures > 0)[:, None], temperature_scaled(logits, temperatures) + noise, logits)
    ids = scores.argmax(dim=-1)  # the first maximum
    return scores.gather(1, ids[:, None]).squeeze(1), ids + token_offset


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


# u is in [0.5, 2^23 - 0.5] / 2^23, so every noise value lies in [g(u_min), g(u_max)] (-2.8, 16.6):
# a token whose scaled logit is more than that span (and a margin for rounding) below its row's
# largest can never be the row's argmax.
_NOISE_SPAN = (_gumbel(torch.tensor((2**23 - 0.5) / 2**23)) - _gumbel(torch.tensor(0.5 / 2**23))).item() + 1.0


def gumbel_argmax_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """gumbel_argmax_ref's tokens, with the noise made only for the tokens that can win (those within
    the noise's span of their row's best scaled logit): the hashing of the whole [S, V] noise was
    most of a CPU job's sampling time. The same values, elementwise, as the reference's."""
    return gumbel_max_cpu(logits, temperatures, seeds, steps, 0)[1]


def gumbel_max_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_max_ref's scores and tokens for a shard of the vocabulary (ids token_offset + [0, V')),
    the noise made only for the tokens that can win (gumbel_argmax_cpu)."""
    if logits.shape[-1] == 0:
        return gumbel_max_ref(logits, temperatures, seeds, steps, token_offset)
    noisy = temperatures > 0
    scaled = temperature_scaled(logits, temperatures)
    best_scaled = scaled.amax(dim=-1)
    if not torch.isfinite(best_scaled[noisy]).all():  # NaN, inf or all masked: as the reference does
        return gumbel_max_ref(logits, temperatures, seeds, steps, token_offset)
    rows, cols = ((scaled >= (best_scaled - _NOISE_SPAN)[:, None]) & noisy[:, None]).nonzero(as_tuple=True)
    scores = scaled[rows, cols] + _gumbel(_uniform_at(_row_keys(seeds, steps)[rows], cols + token_offset))
    best = torch.full_like(best_scaled, float("-inf")).scatter_reduce(0, rows, scores, "amax")
    at_best = scores == best[rows]  # the first token at the row's maximum, as argmax takes it
    first = torch.full_like(seeds, logits.shape[-1]).scatter_reduce(0, rows[at_best], cols[at_best], "amin")
    if not noisy.all():  # greedy rows: the first largest logit
        greedy = logits.argmax(dim=-1)
        first = torch.where(noisy, first, greedy)
        best = torch.where(noisy, best, logits.gather(1, greedy[:, None]).squeeze(1))
    return best, first + token_offset


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
