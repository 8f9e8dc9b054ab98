import pytest
import torch

from batchgen.kernels.head_rmsnorm import head_rmsnorm_, head_rmsnorm_ref, head_rmsnorm_triton
from batchgen.kernels.rmsnorm import rmsnorm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, Hq, Hk, D): one token; D not a power of 2; more heads than one program takes (D = 128: 16 a program);
# qwen3-30b-a3b's heads at TP=1 on the GPU
SHAPES = [(1, 2, 1, 16), (5, 6, 2, 24), (3, 20, 4, 128)] + [
    pytest.param(*shape, marks=pytest.mark.gpu) for shape in [(257, 32, 4, 128), (1031, 16, 8, 128)]
]


def _qkv(tokens, num_q, num_kv, head_dim, dtype, device, pad=3):
    """A qkv product's output whose rows are `pad` elements wider than q, k and v (a row stride past them)."""
    width = (num_q + 2 * num_kv) * head_dim
    return (torch.randn(tokens, width + pad, dtype=dtype, device=device) * 3)[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_q,num_kv,head_dim", SHAPES)
def test_head_rmsnorm_matches_each_heads_rmsnorm(device, assert_close, dtype, tokens, num_q, num_kv, head_dim):
    torch.manual_seed(0)
    qkv = _qkv(tokens, num_q, num_kv, head_dim, dtype, device)
    q_weight = torch.rand(head_dim, dtype=dtype, device=device) + 0.5
    k_weight = torch.rand(head_dim, dtype=dtype, device=device) + 0.5
    before = qkv.clone()
    head_rmsnorm_triton(qkv, num_q, num_kv, q_weight, k_weight, 1e-6)
    q_size, kv_size = num_q * head_dim, num_kv * head_dim
    # each head as the model normalised it before: a copy of q's (k's) heads as rows, rmsnorm'd
    q_rows = before[:, :q_size].reshape(-1, head_dim)
    k_rows = before[:, q_size:q_size + kv_size].reshape(-1, head_dim)
    assert_close(qkv[:, :q_size].reshape(-1, head_dim), rmsnorm_ref(q_rows, q_weight, 1e-6))
    assert_close(qkv[:, q_size:q_size + kv_size].reshape(-1, head_dim), rmsnorm_ref(k_rows, k_weight, 1e-6))
    assert torch.equal(qkv[:, q_size + kv_size:], before[:, q_size + kv_size:])  # v untouched
    ref = before.clone()
    head_rmsnorm_ref(ref, num_q, num_kv, q_weight, k_weight, 1e-6)
    assert_close(qkv, ref)


def test_each_head_alone_whatever_else_is_in_the_batch(device):
    """A token's normalised heads are the same bits alone and beside other tokens."""
    torch.manual_seed(1)
    qkv = _qkv(9, 4, 2, 32, torch.bfloat16, device)
    weights = [torch.rand(32, dtype=torch.bfloat16, device=device) + 0.5 for _ in range(2)]
    alone = qkv[4:5].clone()
    head_rmsnorm_triton(qkv, 4, 2, *weights, 1e-6)
    head_rmsnorm_triton(alone, 4, 2, *weights, 1e-6)
    assert torch.equal(qkv[4:5], alone)


def test_no_tokens_and_the_dispatch(device):
    weights = torch.ones(8, device=device)
    empty = torch.empty(0, 32, device=device)
    head_rmsnorm_(empty, 2, 1, weights, weights, 1e-6)
    with pytest.raises(AssertionError):  # weights in another dtype than qkv: the in-place result could not hold
        head_rmsnorm_(torch.randn(2, 32, device=device), 2, 1, weights.half(), weights.half(), 1e-6)
