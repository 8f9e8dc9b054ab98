"""The fused MoE (kernels/fused_moe.py, kernels/moe_align.py, kernels/moe_sum.py) against its torch
reference, on tiny shapes whose K and N are not whole blocks, whole and with the experts split over ranks;
the reference against the formula; the router's top-k."""
import pytest
import torch
import torch.nn.functional as F

import batchgen.kernels.fused_moe as fused_moe_module
import batchgen.kernels.moe_config as moe_config_module
from batchgen.kernels.e4m3 import dequantize_weight_ref, quantize_ref, quantize_weight_ref, round_ref
from batchgen.kernels.fused_moe import (
    dequantize_experts,
    fused_moe_reference,
    fused_moe_triton,
    quantize_experts,
)
from batchgen.kernels.moe_align import max_slots, moe_align_torch, moe_align_triton
from batchgen.kernels.moe_config import GemmTile, MoeConfig, default_config, pick_config, warmup_token_counts
from batchgen.kernels.moe_router import select_experts, select_experts_reference, select_experts_triton
from batchgen.kernels.moe_sum import BLOCK_H, sum_kept_pairs, sum_kept_pairs_reference
from tests.kernels.conftest import HAS_CUDA, INTERPRET

# Interpreter-sized tiles: 16-slot blocks, 16 columns, 32-wide K steps (K and N of the cases below are
# not all whole steps); a 32-slot block for the align's other padding
SMALL = MoeConfig(16, GemmTile(16, 32, 4, 1), GemmTile(16, 32, 4, 1))
WIDE_M = MoeConfig(32, GemmTile(32, 16, 4, 1), GemmTile(16, 16, 4, 1))


def routing(num_tokens: int, num_experts: int, top_k: int, kind: str, seed: int = 0) -> torch.Tensor:
    """topk_ids [T, k] int32, distinct experts a token: "random" over all experts, "skip_first" never
    expert 0 (an expert with no tokens), "one_expert" every token's first choice expert 1 (the rest
    fixed too: every pair on k experts)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_expert":
        return torch.tensor([[1 + j for j in range(top_k)]] * num_tokens, dtype=torch.int32)
    low = 1 if kind == "skip_first" else 0
    rows = [low + torch.randperm(num_experts - low, generator=gen)[:top_k] for _ in range(num_tokens)]
    return torch.stack(rows).to(torch.int32)


def moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device, kind="random", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    topk_ids = routing(num_tokens, num_experts, top_k, kind, seed)
    return [t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)]


# (T, E, k, H, I, routing, config)
CASES = [
    (1, 4, 1, 32, 24, "random", SMALL),
    (3, 8, 2, 64, 48, "random", SMALL),
    (17, 8, 2, 48, 40, "random", SMALL),
    (17, 4, 1, 64, 32, "one_expert", SMALL),  # one expert: a full block and a partial one
    (17, 8, 2, 40, 24, "skip_first", SMALL),  # expert 0 gets no tokens
    (3, 4, 2, 64, 48, "one_expert", WIDE_M),
    (17, 8, 1, 32, 48, "random", WIDE_M),  # K and N whole steps: the unmasked loads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,kind,config", CASES)
def test_fused_moe(device, assert_close, dtype, num_tokens, num_experts, top_k, hidden, inter, kind, config):
    x, w13, w2, topk_weights, topk_ids = moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device, kind)
    got = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, config)
    # the products sum in another order: gate/up may round the other way, and the down product after it
    assert_close(got, fused_moe_reference(x, w13, w2, topk_weights, topk_ids), scale=2)



@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_writes_into_out(device, top_k):
    """out (the tensor-parallel all-reduce's buffer, where the layer hands its sum on): the sum over the k is
    written there, the very values fused_moe gives without it."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(17, 8, top_k, 48, 40, torch.bfloat16, device)
    want = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, SMALL)
    out = torch.full_like(x, float("nan"))
    got = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, SMALL, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    ref = fused_moe_module.fused_moe(x.cpu(), w13.cpu(), w2.cpu(), topk_weights.cpu(), topk_ids.cpu())
    out = torch.full_like(ref, float("nan"))
    assert fused_moe_module.fused_moe(x.cpu(), w13.cpu(), w2.cpu(), topk_weights.cpu(), topk_ids.cpu(), out=out) is out
    assert torch.equal(out, ref)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,ranks", [(17, 8, 2, 2), (5, 6, 1, 2), (17, 8, 2, 4)])
def test_fused_moe_over_expert_shards(device, assert_close, dtype, num_tokens, num_experts, top_k, ranks):
    """Experts split whole over ranks: each rank's kernels on its experts give its pairs' sums (zero for a
    token with none there), which sum over the ranks to the whole layer; the reference's shards likewise."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(num_tokens, num_experts, top_k, 48, 40, dtype, device)
    local = num_experts // ranks
    shards = [(rank * local, slice(rank * local, (rank + 1) * local)) for rank in range(ranks)]
    parts = [fused_moe_triton(x, w13[own], w2[own], topk_weights, topk_ids, SMALL, first_expert=first,
                              routed_experts=num_experts) for first, own in shards]
    refs = [fused_moe_reference(x, w13[own], w2[own], topk_weights, topk_ids, first_expert=first)
            for first, own in shards]
    for part, ref in zip(parts, refs):
        assert_close(part, ref, scale=2)
    whole = fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
    assert_close(torch.stack(refs).float().sum(0).to(dtype), whole, scale=2)
    untouched = [t for t in range(num_tokens) if all(int(e) >= local for e in topk_ids[t])]
    assert untouched and not parts[0][untouched].any()  # (rank 0 has none of these tokens' experts)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_fp8_experts_over_expert_shards(device, monkeypatch, block):
    """FP8 experts split whole over two ranks: each rank's weights and scales (its experts' rows of both)
    give the reference's sums of its pairs."""
    if INTERPRET and not HAS_CUDA:  # (as test_fused_moe_fp8)
        monkeypatch.setattr(fused_moe_module, "quantize", lambda rows, group: quantize_ref(rows, group=group))
    x, w13, w2, topk_weights, topk_ids = moe_inputs(17, 8, 2, 160, 136, torch.float32, device)
    q13, q2, fp8 = quantize_experts(w13, w2, block)
    for first in (0, 4):
        own = slice(first, first + 4)
        shard = type(fp8)(fp8.w13_scale[own], fp8.w2_scale[own], block)
        got = fused_moe_triton(x, q13[own], q2[own], topk_weights, topk_ids, SMALL, fp8=shard, first_expert=first,
                               routed_experts=8)
        want = fused_moe_reference(x, q13[own], q2[own], topk_weights, topk_ids, shard, first_expert=first)
        err = (got - want).abs()  # (as test_fused_moe_fp8: a value of h on a rounding boundary may move)
        assert err.mean() < 1e-3 * want.abs().mean() and (err > 1e-4 * want.abs().max()).float().mean() < 0.02


@pytest.mark.parametrize("top_k", [1, 3])
def test_sum_kept_pairs(device, top_k):
    """The sum over a token's pairs of one rank's experts: rows of other experts never count, even unwritten
    (NaN here); columns past the last whole block; into out."""
    gen = torch.Generator().manual_seed(top_k)
    num_tokens, hidden = 9, BLOCK_H + 40
    topk_ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    y = torch.randn(num_tokens * top_k, hidden, generator=gen)
    kept = ((topk_ids >= 2) & (topk_ids < 5)).reshape(-1)
    y[~kept] = float("nan")
    want = sum_kept_pairs_reference(y, topk_ids, 2, 3)
    assert not want.isnan().any()
    torch.testing.assert_close(want, torch.where(kept.view(num_tokens, top_k, 1), y.view(num_tokens, top_k, -1),
                                                 0.0).sum(1))
    out = torch.full((num_tokens, hidden), float("nan"), device=device)
    got = sum_kept_pairs(y.to(device), topk_ids.to(device), 2, 3, out)
    assert got is out
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_default_config(device, assert_close, dtype):
    """pick_config's tiles (16-slot blocks, K steps of 128 past H) at an H and I of a few steps."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(5, 8, 2, 256, 128, dtype, device)
    assert pick_config(5, 256, 128, 8, 2, x.device).block_m == 16
    got = fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    assert_close(got, fused_moe_reference(x, w13, w2, topk_weights, topk_ids), scale=2)


def test_fused_moe_strided_rows(device, assert_close):
    """x a column slice of a wider tensor (rows apart by more than H) and experts' weights views of
    larger ones (rows and experts apart by more than their sizes)."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(5, 4, 2, 32, 24, torch.float32, device)
    wide_x = torch.randn(5, 48, device=device)
    wide_x[:, :32] = x
    wide_w13 = torch.randn(4, 64, 40, device=device)
    wide_w13[:, :48, :32] = w13
    wide_w2 = torch.randn(4, 40, 24, device=device)
    wide_w2[:, :32] = w2
    got = fused_moe_triton(wide_x[:, :32], wide_w13[:, :48, :32], wide_w2[:, :32], topk_weights, topk_ids, SMALL)
    assert_close(got, fused_moe_reference(x, w13, w2, topk_weights, topk_ids), scale=2)


def test_reference_is_the_formula():
    """out[t] = sum_j w[t, j] * (silu(x[t] Wg^T) * (x[t] Wu^T)) Wd^T, token by token, in fp32."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(6, 4, 2, 16, 12, torch.float32, "cpu")
    want = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            e = int(topk_ids[t, j])
            gate, up = w13[e, :12] @ x[t], w13[e, 12:] @ x[t]
            want[t] += topk_weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, topk_weights, topk_ids), want)


# (T, E, k, routing, BLOCK_M): one chunk of pairs; 6 experts (not a power of two); an empty expert;
# all on one expert; pairs in several chunks (128 experts: 64 pairs a chunk), and in more chunks than
# a step of the counts' sum takes (32); 32-slot blocks
ALIGN_CASES = [(1, 4, 1, "random", 16), (17, 6, 2, "random", 16), (17, 8, 2, "skip_first", 16),
               (17, 4, 1, "one_expert", 16), (40, 128, 8, "random", 16), (300, 128, 8, "random", 16),
               (3, 8, 2, "random", 32)]


# (experts of the model, a rank's): halves of 8; quarters of 128 (pairs in several chunks); halves of 6 (3: not
# a power of two)
SHARDS = [(8, 4), (128, 32), (6, 3)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,kind,block_m", ALIGN_CASES)
def test_moe_align(device, num_tokens, num_experts, top_k, kind, block_m):
    """Each expert's pairs, ascending, at slots from the padded counts' prefix sums, the sentinel
    T*k in the padding, each block's expert; the Triton kernels and the torch ops agree."""
    topk_ids = routing(num_tokens, num_experts, top_k, kind).to(device)
    check_align(topk_ids, num_experts, block_m, 0)


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 1, 16), (17, 2, 16), (300, 8, 16), (3, 2, 32)])
@pytest.mark.parametrize("shard", SHARDS)
def test_moe_align_keeps_this_ranks_experts(device, num_tokens, top_k, block_m, shard):
    """Experts split over ranks: a rank groups only the pairs routed to its experts (local ids from 0) and
    gives the others no slot; so the sum of its blocks' pairs over all ranks is every pair once."""
    routed, local = shard
    top_k = min(top_k, routed)
    topk_ids = routing(num_tokens, routed, top_k, "random", seed=num_tokens).to(device)
    kept = [check_align(topk_ids, local, block_m, rank * local) for rank in range(routed // local)]
    assert sorted(p for pairs in kept for p in pairs) == list(range(num_tokens * top_k))


def check_align(topk_ids, num_experts, block_m, first_expert):
    """Both aligns of topk_ids against the docstring's definition for experts first_expert ..
    first_expert + num_experts - 1 (local ids from 0); -> the pairs given slots."""
    sorted_ids, block_expert, num_padded = moe_align_torch(topk_ids, num_experts, block_m, first_expert)
    num_pairs = topk_ids.numel()
    slots = max_slots(num_pairs, num_experts, block_m)
    assert sorted_ids.shape == (slots,) and block_expert.shape == (slots // block_m,)
    flat = topk_ids.reshape(-1).cpu().long() - first_expert
    want_ids, want_blocks = [], []
    for expert in range(num_experts):
        pairs = (flat == expert).nonzero().flatten().tolist()
        padded = -(-len(pairs) // block_m) * block_m
        want_ids += pairs + [num_pairs] * (padded - len(pairs))
        want_blocks += [expert] * (padded // block_m)
    assert num_padded.tolist() == [len(want_ids)]
    assert sorted_ids[:len(want_ids)].tolist() == want_ids
    assert block_expert.tolist() == want_blocks + [-1] * (len(block_expert) - len(want_blocks))
    got = moe_align_triton(topk_ids, num_experts, block_m, first_expert)
    assert torch.equal(got[2], num_padded) and torch.equal(got[1], block_expert)
    assert torch.equal(got[0][:len(want_ids)], sorted_ids[:len(want_ids)])  # (slots past those: unread)
    return [p for p in want_ids if p < num_pairs]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_select_experts(renormalize, logits_dtype):
    torch.manual_seed(4)
    logits = (torch.randn(9, 16) * 3).to(logits_dtype)
    weights, ids = select_experts(logits, 4, renormalize)
    want_weights, want_ids = select_experts_reference(logits, 4, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (9, 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 60, 4), (37, 128, 8), (3, 16, 1), (9, 4, 4)])
def test_select_experts_triton(device, renormalize, num_tokens, num_experts, top_k):
    """The router's kernel against the definition: the same experts in the same order (no ties in these
    logits; one row with every logit equal takes the first k), weights within fp32 rounding, any dtype of
    logits, rows not contiguous."""
    gen = torch.Generator().manual_seed(num_tokens * 131 + num_experts)
    for dtype in (torch.float32, torch.bfloat16):
        rows = (torch.randn(num_tokens, num_experts + 3, generator=gen) * 3).to(dtype)
        if num_tokens > 1:
            rows[-1] = 0
        logits = rows[:, :num_experts]  # (rows num_experts + 3 apart)
        weights, ids = select_experts_triton(logits.to(device), top_k, renormalize)
        want_weights, want_ids = select_experts_reference(logits, top_k, renormalize)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (num_tokens, top_k)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_triton_names_an_expert_whatever_the_logits(device, renormalize):
    """Rows with a NaN or an infinite logit (a CUDA graph's padding rows can read NaN from unwritten memory)
    still get k distinct experts in range, in the definition's order (NaN ranked first, as torch's sort
    does), with NaN weights: an id past the experts would send the align kernels out of bounds."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan] * 6, [0.5, nan, 1.0, 2.0, -1.0, 0.0], [0.0, inf, 1.0, 2.0, 3.0, 4.0],
                           [0.1, 0.2, 3.0, 0.3, 2.5, 0.4], [-inf, 0.0, 1.0, -inf, 2.0, 3.0]])
    for top_k in (1, 2, 6):
        weights, ids = select_experts_triton(logits.to(device), top_k, renormalize)
        want_weights, want_ids = select_experts_reference(logits, top_k, renormalize)
        ids = ids.cpu()
        assert ((ids >= 0) & (ids < 6)).all() and all(len(set(row.tolist())) == top_k for row in ids)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert weights[:3].isnan().all() and not weights[3:].isnan().any()


def test_pick_config(monkeypatch):
    """A tuned shape takes the entry of the nearest tuned batch at or above T (past the largest: the
    largest); other shapes the default, 16-slot blocks while an expert gets a few pairs."""
    tuned = {1: MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(32, 128, 4, 4)),
             64: MoeConfig(32, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3)),
             1024: MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))}
    monkeypatch.setattr(moe_config_module, "TUNED", {("cpu", 2048, 768, 128, 8): tuned})
    cpu = torch.device("cpu")
    assert [pick_config(t, 2048, 768, 128, 8, cpu) for t in (1, 2, 64, 65, 4096)] == [
        tuned[1], tuned[64], tuned[64], tuned[1024], tuned[1024]]
    assert pick_config(1, 4096, 14336, 8, 2, cpu) == default_config(1, 4096, 14336, 8, 2)
    assert [default_config(t, 2048, 768, 128, 8).block_m for t in (1, 128, 256, 1024, 4096)] == [16, 16, 32, 64, 128]
    # one token's 8 experts: 32-column tiles give the products' programs two an SM
    assert default_config(1, 2048, 768, 128, 8, sms=132).gate_up.block_n == 32
    assert default_config(128, 2048, 768, 128, 8, sms=132).gate_up.block_n == 64
    fp32 = pick_config(64, 2048, 768, 128, 8, cpu, torch.float32)  # the shared memory of 16-bit tiles
    assert fp32.gate_up == tuned[64].gate_up._replace(block_k=32) and fp32.down.block_k == 32
    # a warm-up at these token counts meets every config
    assert warmup_token_counts(2048, 768, 128, 8, 4096, cpu) == [1, 2, 65]
    assert warmup_token_counts(2048, 768, 128, 8, 64, cpu) == [1, 2]
    defaults = warmup_token_counts(4096, 14336, 8, 2, 1024, cpu)
    assert defaults[0] == 1 and {pick_config(t, 4096, 14336, 8, 2, cpu) for t in range(1, 1025)} == {
        pick_config(t, 4096, 14336, 8, 2, cpu) for t in defaults}


# (T, E, k, H, I, routing, config): H and I not whole 128-groups, more than one group, and one block of
# each expert's pairs full (fp8 dots take K steps of 32 or more on a GPU)
FP8_CASES = [(3, 8, 2, 64, 48, "random", SMALL), (17, 4, 2, 160, 144, "random", SMALL),
             (17, 4, 1, 64, 32, "one_expert", MoeConfig(32, GemmTile(32, 32, 4, 1), GemmTile(16, 32, 4, 1)))]


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,kind,config", FP8_CASES)
def test_fused_moe_fp8(device, monkeypatch, block, num_tokens, num_experts, top_k, hidden, inter, kind, config):
    """e4m3 experts with channel or 128x128-block scales, fp32 x and h rounded to e4m3 (per token, or per
    128-group): the kernels against the reference's fp32 math on the dequantized weights. (Under the
    interpreter the rows are rounded by the torch definition: the interpreter's rounding kernel drops
    some carries, tests/kernels/test_fp8_gemm.py.)"""
    if INTERPRET and not HAS_CUDA:
        monkeypatch.setattr(fused_moe_module, "quantize", lambda rows, group: quantize_ref(rows, group=group))
    x, w13, w2, topk_weights, topk_ids = moe_inputs(num_tokens, num_experts, top_k, hidden, inter, torch.float32,
                                                    device, kind)
    # rows and 128-column blocks of very different sizes: a scale taken from the wrong row, half or block shows
    gen = torch.Generator().manual_seed(3)
    w13 = w13 * 2.0 ** torch.randint(-3, 4, (num_experts, 2 * inter, 1), generator=gen).to(device)
    w13[:, :, 128:] *= 4
    w2 = w2 * 2.0 ** torch.randint(-3, 4, (num_experts, hidden, 1), generator=gen).to(device)
    w2[:, :, 128:] /= 4
    q13, q2, fp8 = quantize_experts(w13, w2, block)
    got = fused_moe_triton(x, q13, q2, topk_weights, topk_ids, config, fp8=fp8).float()
    want = fused_moe_reference(x, q13, q2, topk_weights, topk_ids, fp8).float()
    # (fp32 rows: 16-bit ones are the GPU tests'. A sum in another order may still move a value of h one e4m3
    # step where it lies on a rounding boundary, which moves its token's outputs by a few percent)
    err = (got - want).abs()
    assert err.mean() < 1e-3 * want.abs().mean() and (err > 1e-4 * want.abs().max()).float().mean() < 0.02
    unrounded = fused_moe_reference(x, *dequantize_experts(q13, q2, fp8), topk_weights, topk_ids).float()
    assert (got - unrounded).abs().max() > 0  # (the inputs were rounded)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_fp8_reference_is_the_formula(block):
    """The fp8 reference: out[t] = sum_j w[t, j] * (r(silu(r(x[t]) Wg^T) * (r(x[t]) Wu^T))) Wd^T, with r the
    e4m3 rounding of a row (per token or per group of 128) and W the dequantized weights, token by token."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(5, 4, 2, 160, 136, torch.float32, "cpu")
    q13, q2, fp8 = quantize_experts(w13, w2, block)
    wd13, wd2 = dequantize_experts(q13, q2, fp8)
    group = 128 if block else None
    for e in range(4):  # the scales as published: gate, up and down each alone
        for w, q, rows in ((w13[e, :136], q13[e, :136], slice(0, 136)), (w13[e, 136:], q13[e, 136:], slice(136, 272)),
                           (w2[e], q2[e], slice(None))):
            scale = quantize_weight_ref(w, block)[1]
            assert torch.equal((wd13 if w.shape[0] == 136 else wd2)[e, rows], dequantize_weight_ref(q, scale))
    want = torch.zeros_like(x)
    for t in range(5):
        xr = round_ref(x[t:t + 1], group=group)[0]
        for j in range(2):
            e = int(topk_ids[t, j])
            h = F.silu(wd13[e, :136] @ xr) * (wd13[e, 136:] @ xr)
            want[t] += topk_weights[t, j] * (wd2[e] @ round_ref(h[None], group=group)[0])
    torch.testing.assert_close(fused_moe_reference(x, q13, q2, topk_weights, topk_ids, fp8), want)


def test_pick_config_for_fp8_experts(monkeypatch):
    """FP8 experts: TUNED_FP8's entry for the form where there is one; else the 16-bit tiles with K steps twice
    as long (at most 128 for blocks, a group) and column tiles whose fp32 sums fit a thread's registers."""
    tuned = {1024: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3))}
    monkeypatch.setattr(moe_config_module, "TUNED", {("cpu", 2048, 768, 128, 8): tuned})
    cpu = torch.device("cpu")
    channel = pick_config(1024, 2048, 768, 128, 8, cpu, fp8="channel")
    assert channel == MoeConfig(128, GemmTile(64, 128, 8, 4), GemmTile(128, 128, 8, 3))  # (4 x 128 x 64 / 256)
    block = pick_config(1024, 2048, 768, 128, 8, cpu, fp8="block")
    assert block.gate_up.block_k == block.down.block_k == 128
    mine = MoeConfig(64, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))
    monkeypatch.setattr(moe_config_module, "TUNED_FP8", {("cpu", 2048, 768, 128, 8, "block"): {4096: mine}})
    assert pick_config(1024, 2048, 768, 128, 8, cpu, fp8="block") == mine
    assert pick_config(1024, 2048, 768, 128, 8, cpu, fp8="channel") == channel
