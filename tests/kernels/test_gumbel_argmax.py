import pytest
import torch
import triton
import triton.language as tl

from batchgen.kernels.gumbel_argmax import (
    GROUP,
    _gumbel,
    _gumbel_noise,
    gumbel_argmax,
    gumbel_argmax_cpu,
    gumbel_argmax_ref,
    gumbel_argmax_triton,
    gumbel_max_cpu,
    gumbel_max_ref,
    gumbel_max_triton,
)

# (rows, vocab): one row, a vocabulary not a multiple of the block, several blocks; real vocabularies
# on the GPU.
SHAPES = [(1, 5), (7, 3001), (4, 4099)] + [
    pytest.param(r, v, marks=pytest.mark.gpu) for r, v in [(256, 128256), (3, 151936), (1, 49152)]
]


def inputs(rows, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(device)
    temperatures = torch.rand(rows, generator=g).to(device) + 0.3
    temperatures[::3] = 0.0  # greedy rows among sampled ones
    seeds = torch.randint(0, 2**62, (rows,), generator=g).to(device)
    steps = torch.randint(0, 10_000, (rows,), generator=g).to(device)
    return logits, temperatures, seeds, steps


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_same_tokens_as_the_reference(device, rows, vocab):
    args = inputs(rows, vocab, device)
    out = gumbel_argmax_triton(*args)
    ref = gumbel_argmax_ref(*args)
    # Same noise bits on both sides; a different token only where two scores tie in fp32 rounding.
    logits, temperatures, seeds, steps = args
    assert (out == ref).float().mean() >= 0.99
    greedy = temperatures == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(-1))


def test_masked_entries_are_never_chosen(device):
    logits, temperatures, seeds, steps = inputs(6, 300, device, seed=1)
    temperatures.fill_(5.0)  # hot: the noise dominates, so a leak would show
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[:, 17::31] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    for step in range(20):
        out = gumbel_argmax_triton(masked, temperatures, seeds, steps + step)
        assert allowed.gather(1, out[:, None]).all()


def test_noise_depends_on_seed_and_step_only(device):
    logits, temperatures, seeds, steps = inputs(4, 1000, device, seed=2)
    temperatures.fill_(1.0)
    out = gumbel_argmax_triton(logits, temperatures, seeds, steps)
    # the same rows in another order and beside other rows: the same tokens
    perm = torch.tensor([2, 0, 3, 1], device=device)
    shuffled = gumbel_argmax_triton(logits[perm], temperatures[perm], seeds[perm], steps[perm])
    assert torch.equal(shuffled, out[perm])
    assert not torch.equal(gumbel_argmax_triton(logits, temperatures, seeds, steps + 1), out)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_the_token_does_not_depend_on_the_number_of_parts(device, parts):
    """Ties across a part boundary included: the first best token wins, as with one part."""
    logits, temperatures, seeds, steps = inputs(6, 4099, device, seed=3)
    logits[:, 2047] = logits[:, 3072] = logits[:, 4000] = 50.0  # a tie across a part boundary
    temperatures[:2] = 0.0
    one = gumbel_argmax_triton(logits, temperatures, seeds, steps, parts=1)
    assert torch.equal(gumbel_argmax_triton(logits, temperatures, seeds, steps, parts=parts), one)
    assert one[:2].tolist() == [2047, 2047]


@pytest.mark.parametrize("cuda_path", [True, False])
def test_a_step_offset_and_a_kept_copy(device, cuda_path):
    """steps + step_offset is what a row draws at (kept sampling parameters pass the offset, not a
    new tensor); keep[:S] receives the tokens, the rest of it stays; offsets past 2^32 wrap as the
    steps themselves do."""
    if not cuda_path and device != "cpu":
        pytest.skip("the CPU path on a CPU")
    fn = gumbel_argmax_triton if cuda_path else gumbel_argmax
    logits, temperatures, seeds, steps = inputs(5, 3001, device, seed=5)
    for offset in (1, 16, 2**32 + 3):
        keep = torch.full((8,), -1, dtype=torch.int64, device=device)
        got = fn(logits, temperatures, seeds, steps, step_offset=offset, keep=keep)
        assert torch.equal(got, fn(logits, temperatures, seeds, steps + offset))
        assert torch.equal(keep[:5], got) and keep[5:].tolist() == [-1, -1, -1]
    assert not torch.equal(got, fn(logits, temperatures, seeds, steps))  # (the offset moved the noise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(7, 3001), pytest.param(256, 128256, marks=pytest.mark.gpu)])
def test_16_bit_logits_draw_as_their_values_in_fp32(device, dtype, rows, vocab):
    """A step that only samples its logits has them in the model's dtype (executor/model_runner.py): the kernel
    reads them as those same values in fp32, greedy rows, a step offset and a kept copy included."""
    logits, temperatures, seeds, steps = inputs(rows, vocab, device, seed=6)
    narrow = logits.to(dtype)
    keep = torch.full((rows,), -1, dtype=torch.int64, device=device)
    got = gumbel_argmax_triton(narrow, temperatures, seeds, steps, step_offset=3, keep=keep)
    assert torch.equal(got, gumbel_argmax_triton(narrow.float(), temperatures, seeds, steps + 3))
    assert torch.equal(keep, got)


# Seed 3353 at step 0 hashes token 2460 to the top 24-bit value: where u was built from 24 bits, u
# rounded to 1.0 there and its noise was +inf.
TOP_NOISE_SEED, TOP_NOISE_TOKEN = 3353, 2460


@pytest.mark.parametrize("masked", [False, True])
def test_the_noise_is_finite_for_every_token(device, masked):
    """A token with a hopeless logit (or a masked one) is never drawn, whatever its noise: with
    u = 1 it won as +inf (or, masked, as -inf + inf = NaN under torch's argmax)."""
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0))
    logits[0, TOP_NOISE_TOKEN] = -1e4
    if masked:
        keep = logits[0, 7].item()
        logits.fill_(float("-inf"))
        logits[0, 7] = keep
    args = [logits.to(device), torch.tensor([1.0], device=device), torch.tensor([TOP_NOISE_SEED], device=device),
            torch.tensor([0], device=device)]
    for fn in (gumbel_argmax_ref, gumbel_argmax_triton):
        token = fn(*args).item()
        assert token != TOP_NOISE_TOKEN and (token == 7 or not masked)


@pytest.mark.parametrize("scale", [0.02, 1.0, 5.0, 100.0])  # temperatures x 0.3..1.3: from noise-dominated to peaked
def test_cpu_path_gives_the_reference_tokens(scale):
    """Noise made only for the tokens that can win: exactly the reference's tokens, across 400 rows, with
    masked entries, greedy rows, ties, a row masked but for one token and a row masked entirely."""
    for seed in range(20):
        logits, temperatures, seeds, steps = inputs(20, 3001, "cpu", seed=seed)
        temperatures *= scale
        logits[1, ::2] = float("-inf")
        logits[2, 5:9] = logits[2].max()  # a tie at the top
        logits[3, :] = float("-inf")
        logits[3, 1234] = 0.0
        if seed % 5 == 0:
            logits[4, :] = float("-inf")  # nothing allowed: the reference's answer (token 0)
        assert torch.equal(gumbel_argmax_cpu(logits, temperatures, seeds, steps),
                           gumbel_argmax_ref(logits, temperatures, seeds, steps))


@pytest.mark.parametrize("offset", [0, 1000, 64128])
def test_a_shard_scores_its_groups_as_the_whole_vocabulary_does(device, offset):
    """gumbel_max_* on columns [offset, offset + 900) of a vocabulary and on the columns before: the
    better of the two shards' best scores (ties to the first) is the whole vocabulary's token, each
    group and token scored by its id."""
    logits, temperatures, seeds, steps = inputs(7, offset + 900, device, seed=4)
    head, shard = logits[:, :offset].contiguous(), logits[:, offset:].contiguous()
    ref_best, ref_ids = gumbel_max_ref(shard, temperatures, seeds, steps, offset)
    assert ((ref_ids >= offset) & (ref_ids < offset + 900)).all()
    head_best, head_ids = gumbel_max_ref(head, temperatures, seeds, steps, 0)
    combined = torch.where(ref_best > head_best, ref_ids, head_ids)
    assert torch.equal(combined, gumbel_argmax_ref(logits, temperatures, seeds, steps))
    on_cpu = [t.cpu() for t in (shard, temperatures, seeds, steps)]  # (torch's logsumexp rounds otherwise on a GPU)
    assert all(torch.equal(a, b) for a, b in zip(gumbel_max_cpu(*on_cpu, offset), gumbel_max_ref(*on_cpu, offset)))
    best, ids = gumbel_max_triton(shard, temperatures, seeds, steps, offset)
    assert (ids == ref_ids).float().mean() >= 0.85  # (a tie in fp32 rounding may pick another)
    same = ids == ref_ids
    torch.testing.assert_close(best[same], ref_best[same], rtol=1e-5, atol=1e-5)
    # the token the whole-vocabulary kernel gives where the shard's best is the row's best
    full = gumbel_argmax_triton(logits, temperatures, seeds, steps)
    here = (full >= offset)
    assert torch.equal(ids[here], full[here])


# (the kernel's on a GPU only: 4,000 rows take minutes under the interpreter, and on a CPU the tests above
# hold the kernel to the reference's tokens, which the CPU path draws)
@pytest.mark.parametrize("kernel", [pytest.param(True, marks=pytest.mark.gpu), False])
def test_samples_follow_the_softmax_across_groups(device, kernel):
    """Two levels (a group by its mass, then a token in it) draw each token with its softmax
    probability at the row's temperature: 4,000 rows of 5 groups, each row its own seed."""
    if not kernel and device != "cpu":
        pytest.skip("the CPU path on a CPU")
    probs = torch.tensor([0.3, 0.05, 0.15, 0.02] + [0.0] * 9 + [0.1] + [0.38 / 26] * 26)  # 40 tokens
    assert GROUP < 40 and probs.sum().item() == pytest.approx(1.0)
    rows = 4000
    temperature = 0.5
    logits = (probs.log() * temperature)[None].repeat(rows, 1)  # softmax(logits / T) = probs
    args = [logits.to(device), torch.full((rows,), temperature, device=device),
            torch.arange(rows, device=device) * 7919, torch.full((rows,), 3, device=device)]
    tokens = (gumbel_argmax_triton if kernel else gumbel_argmax)(*args).cpu()
    freq = torch.bincount(tokens, minlength=40).float() / rows
    assert freq[4:13].sum() == 0  # probability 0 (-inf): never
    torch.testing.assert_close(freq[:4], probs[:4], atol=0.025, rtol=0)
    assert freq[13].item() == pytest.approx(0.1, abs=0.02) and freq[14:].sum().item() == pytest.approx(0.38, abs=0.03)


@triton.jit
def _noise_of_every_bits_kernel(out_ptr, BLOCK: tl.constexpr):
    bits = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    tl.store(out_ptr + bits, _gumbel_noise(bits))


def test_the_noise_is_accurate_for_every_uniform(device):
    """The kernel's noise for each of the 2^23 values of u, against -ln(-ln u) in fp64: within 4e-6
    (lg2.approx alone, as u -> 1, gave errors of order 1: on the largest noises, the ones that win).
    On the CPU the interpreter takes the exact log2 and checks the series and the bit trick for u."""
    out = torch.empty(2**23, dtype=torch.float32, device=device)
    _noise_of_every_bits_kernel[(2**23 // 2**16,)](out, BLOCK=2**16)
    u = (torch.arange(2**23, dtype=torch.float64) + 0.5) / 2**23
    assert (out.cpu().double() - _gumbel(u)).abs().max().item() < 4e-6
