from types import SimpleNamespace

import pytest
import torch

from batchgen.kernels import decode_mlp_gluon
from batchgen.kernels.decode_mlp import decode_mlp, decode_mlp_ref
from batchgen.layers.one_row_mlp import OneRowMLP
from batchgen.layers.packed_linear import stream_product
from tests.kernels.test_decode_mlp import _inputs

needs_gluon = pytest.mark.skipif(decode_mlp_gluon.gluon is None, reason="this Triton has no Gluon")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [8192, 1000, 131, 40])  # llama-3.2-1b's; partial blocks; fewer rows than SMs
def test_decode_mlp_gluon(dtype, inter):
    """The persistent kernel against the reference: the MLP added onto a sum that was not zero, the
    next layer's sum zeroed, x + residual bit for bit (H = 2048, the only H it takes)."""
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(2048, inter, dtype, "cuda")
    out_sum = torch.full((1, 2048), 0.5, device="cuda")
    next_sum = torch.ones(1, 2048, device="cuda")
    new_residual = decode_mlp_gluon.decode_mlp_gluon(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t,
                                                     out_sum, next_sum)
    want_sum, want_residual = decode_mlp_ref(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t)
    assert torch.equal(new_residual, want_residual)
    assert (next_sum == 0).all()
    # gate and up are rounded to 16 bits as the reference rounds them, after fp32 sums in another
    # order: a rounding may flip (as for kernels/decode_mlp.py's kernel)
    torch.testing.assert_close(out_sum, want_sum + 0.5, rtol=2e-2, atol=2e-2 * want_sum.abs().max().item())


@pytest.mark.gpu
@needs_gluon
def test_decode_mlp_gluon_fp32_input():
    """x may be an fp32 sum (a split-K part): rounded to the residual's dtype first, as the reference does."""
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(2048, 1000, torch.bfloat16, "cuda", x_dtype=torch.float32)
    out_sum, next_sum = torch.zeros(1, 2048, device="cuda"), torch.zeros(1, 2048, device="cuda")
    new_residual = decode_mlp_gluon.decode_mlp_gluon(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t,
                                                     out_sum, next_sum)
    want_sum, want_residual = decode_mlp_ref(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out_sum, want_sum, rtol=2e-2, atol=2e-2 * want_sum.abs().max().item())


def _linked_pair(w_gate_up, w_down_t):
    """Two OneRowMLPs of the same weights, each the other's next layer (a layer's sum is not the next's).
    Both are returned: the ring's links are weak, as the model's layers hold its MLPs."""
    first, second = OneRowMLP(w_gate_up, w_down_t.t()), OneRowMLP(w_gate_up, w_down_t.t())
    first.next, second.next, first.first, second.first = second, first, first, first
    return first, second


@pytest.mark.gpu
@needs_gluon
def test_one_row_mlp_takes_gluon_after_its_check(monkeypatch):
    """The one-row MLP layer takes the persistent kernel only once its check passed, for H = 2048 only."""
    device = torch.device("cuda")
    launches = []
    real = decode_mlp_gluon.decode_mlp_gluon
    monkeypatch.setattr(decode_mlp_gluon, "decode_mlp_gluon", lambda *a: launches.append(1) or real(*a))
    monkeypatch.setattr(decode_mlp_gluon, "_CHECKED", {})

    def run(h, inter):
        x, residual, norm_weight, w_gate_up, w_down_t = _inputs(h, inter, torch.bfloat16, "cuda")
        layer, _following = _linked_pair(w_gate_up, w_down_t)
        layer(SimpleNamespace(weight=norm_weight, eps=1e-5), x, residual)
        torch.testing.assert_close(layer.sum, decode_mlp_ref(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t)[0],
                                   rtol=2e-2, atol=2e-2)

    run(2048, 256)
    assert launches == []  # not checked yet: the Triton kernel
    if torch.cuda.get_device_capability()[0] < 9:
        assert not decode_mlp_gluon.check(device, torch.bfloat16, 2048)
        pytest.skip("the persistent kernel is taken on Hopper and later")
    assert decode_mlp_gluon.check(device, torch.bfloat16, 2048)
    launches.clear()  # (the check ran the kernel itself)
    run(2048, 256)
    assert launches == [1]
    run(1024, 256)  # another H: the Triton kernel
    assert launches == [1]


def test_never_taken_off_the_gpu():
    """No check passes off the GPU; decode_mlp keeps its reference there."""
    cpu = torch.device("cpu")
    assert not decode_mlp_gluon.check(cpu, torch.bfloat16, 2048)
    assert not decode_mlp_gluon.usable(cpu, torch.bfloat16, 2048)
    x, residual, norm_weight, w_gate_up, w_down_t = _inputs(2048, 16, torch.float32, "cpu")
    out_sum, next_sum = torch.zeros(1, 2048), torch.ones(1, 2048)
    decode_mlp(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t, out_sum, next_sum)
    torch.testing.assert_close(out_sum, decode_mlp_ref(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t)[0])
    assert (next_sum == 0).all()


@needs_gluon
def test_descriptors_read_each_matrix_as_rows_of_256():
    """The TMA descriptors: gate rows, up rows and W_down^T, each a [8 I, 256] view of its rows (a weight
    row is 8 rows of the view), boxes of one block (8 weight rows, 32 KB at 16 bits), unswizzled."""
    inter = 40
    w_gate_up = torch.zeros(2 * inter, 2048, dtype=torch.bfloat16)
    w_down_t = torch.zeros(inter, 2048, dtype=torch.bfloat16)
    gate, up, down = decode_mlp_gluon._descriptors(w_gate_up, w_down_t)
    for desc, base in ((gate, w_gate_up), (up, w_gate_up[inter:]), (down, w_down_t)):
        assert desc.base.data_ptr() == base.data_ptr()
        assert list(desc.shape) == [8 * inter, 256] and list(desc.strides) == [256, 1]
        assert list(desc.block_shape) == [64, 256] and desc.layout.swizzle_byte_width == 0


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [2048, 1000, 40])  # llama-3.2-1b's o; partial blocks; fewer blocks than SMs
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_row_product_gluon(dtype, n, out_dtype):
    """The one-row product through the ring against fp32 products rounded once (skinny_gemm_ref)."""
    from batchgen.kernels.skinny_gemm import skinny_gemm_ref
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, 2048, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(n, 2048, generator=gen, device="cuda") * 2048**-0.5).to(dtype)
    got = decode_mlp_gluon.row_product_gluon(x, w, out_dtype)
    want = skinny_gemm_ref(x, w, out_dtype=out_dtype)
    assert got.dtype == want.dtype and got.shape == (1, n)
    # fp32 sums in another order: a 16-bit rounding may flip
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_gluon
def test_stream_product_takes_the_row_product_where_it_fits(monkeypatch):
    """The layers' one-row product goes to the Gluon kernel for H = 2048 rows and at most TILES blocks
    an SM once its check passed; not an LM head's, not two rows."""
    launches = []
    real = decode_mlp_gluon.row_product_gluon
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    o, head = (torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for n in (2048, 128256))
    monkeypatch.setattr(decode_mlp_gluon, "_ROW_CHECKED", {})
    if torch.cuda.get_device_capability()[0] < 9:
        assert not decode_mlp_gluon.row_product_takes(x, o)
        pytest.skip("the Gluon kernels are taken on Hopper and later")
    assert decode_mlp_gluon.row_product_takes(x, o)  # (its check, with the real kernel)
    monkeypatch.setattr(decode_mlp_gluon, "row_product_gluon", lambda *a: launches.append(1) or real(*a))
    torch.testing.assert_close(stream_product(x, o).float(), (x.float() @ o.float().t()), rtol=1e-2, atol=1e-2)
    assert launches == [1]
    stream_product(x, head, out_dtype=torch.float32)  # too many blocks for the ring: the skinny kernel
    stream_product(torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16), o)  # two rows: the skinny kernel
    assert launches == [1]


def test_row_product_never_taken_off_the_gpu():
    x, w = torch.randn(1, 2048), torch.randn(2048, 2048)
    assert not decode_mlp_gluon.row_product_takes(x.bfloat16(), w.bfloat16())
    torch.testing.assert_close(stream_product(x, w), x @ w.t(), rtol=1e-4, atol=1e-4)  # skinny_gemm's reference
