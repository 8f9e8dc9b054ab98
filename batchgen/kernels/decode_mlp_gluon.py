"""The one-row MLP of kernels/decode_mlp.py (same contract, same rounding) as a persistent kernel in
Gluon, Triton's dialect with explicit layouts, where the installed Triton has it and a start-up check
passed (`check`), for H = 2,048 (llama-3.2-1b's: the shape measured).

    P = the SM count;  program p owns the intermediate rows [p R, (p + 1) R), R = ceil(I / P)

Program p walks its rows in blocks of BJ = 8 (one row a warp), the next block's gate/up rows in
flight while this block's are summed; gate and up are each a warp's sum over its row, SiLU-and-mul
gives the block's 8 activations, and the block's 8 rows of W_down^T are read with all 8 rows of a
column group in one thread, so the down product's sum over the block stays in the thread. The
program's [H] share of the down product stays in registers over its blocks and is added into `sum`
once (fp32 atomics: P adds of [H], where kernels/decode_mlp.py's 512 programs add 512).

Why: kernels/decode_mlp.py's 512 programs of 16 rows take 250 registers a thread, two programs an SM
in two waves, so the SMs end unevenly; here every SM streams the same bytes in one program (graph
replays of 16 layers of llama-3.2-1b on an H200: 28.1 against 30.1 us a layer, W-decode1 0.863
against 0.900 ms a token; KERNELS.md, session 20). A Triton kernel cannot put a block's rows in one
thread for the down product's sum (its layouts are the compiler's), which made such blocks slow there.

Gluon is experimental: the kernel is compiled and checked against the Triton kernel once a device
(`check`, at start-up, before any CUDA graph), and the engine takes it only where that passed.
BATCHGEN_GLUON_MLP=0 turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from batchgen.kernels.decode_attention import device_index, num_sms
from batchgen.kernels.pdl import pdl_launch_args

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.extra import cuda as cuda_extra
except Exception:  # noqa: BLE001 (a Triton without Gluon, or with another one: the Triton kernel)
    gluon = None

HIDDEN = 2048  # H taken: 256 columns a warp-row times NUM_WARPS, one column group a thread
NUM_WARPS = 8  # = BJ, the rows of a block (one a warp)
_CHECKED: dict[tuple[int, torch.dtype], bool] = {}  # (device index, dtype) -> check passed


@functools.cache
def _jitted():
    """The kernel, jitted at its first launch (in `check`'s try): an experimental API that another
    Triton may reject must not fail the import of batchgen."""
    return gluon.jit(do_not_specialize=["eps", "rows_per_program"])(_decode_mlp_gluon_kernel)


def _decode_mlp_gluon_kernel(
    x_ptr, res_ptr, new_res_ptr, norm_w_ptr, eps, w_gate_up_ptr, w_down_t_ptr, sum_ptr, next_sum_ptr,
    H, I, rows_per_program,  # (arguments as kernels/decode_mlp.py's; R = rows_per_program)
    NW: gl.constexpr,  # warps = rows of a block
    PDL: gl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    BJ: gl.constexpr = NW
    HC: gl.constexpr = 256 * NW  # == H
    # gate/up blocks [BJ, H]: a row a warp, 8 contiguous columns a thread
    LG: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    # W_down^T blocks [BJ, H]: every row of 8 contiguous columns in one thread
    LD: gl.constexpr = gl.BlockedLayout([BJ, 8], [1, 32], [1, NW], [1, 0])
    pid = gl.program_id(0)
    start = pid * rows_per_program
    end = gl.minimum(start + rows_per_program, I)
    rows_g = gl.arange(0, BJ, layout=gl.SliceLayout(1, LG))
    cols_g = gl.arange(0, HC, layout=gl.SliceLayout(0, LG))
    rows_d = gl.arange(0, BJ, layout=gl.SliceLayout(1, LD))
    cols_d = gl.arange(0, HC, layout=gl.SliceLayout(0, LD))
    # (full-shape masks, rows and columns: with the rows' mask broadcast over the columns the kernel took
    # 29.5 against 28.1 us a layer, with as many 16-byte loads in its PTX; KERNELS.md, session 20)
    cols_g_ok = gl.expand_dims(cols_g < H, 0)
    cols_d_ok = gl.expand_dims(cols_d < H, 0)
    j = start + rows_g
    offs = gl.expand_dims(j.to(gl.int64) * H, 1) + gl.expand_dims(cols_g, 0)
    mask = gl.expand_dims(j < end, 1) & cols_g_ok
    gate_w = gl.load(w_gate_up_ptr + offs, mask=mask, other=0.0)  # the first block before the PDL wait
    up_w = gl.load(w_gate_up_ptr + I * H + offs, mask=mask, other=0.0)
    if PDL:  # kernels/pdl.py's wait_for_prior_kernels
        cuda_extra.gdc_wait()
        cuda_extra.gdc_launch_dependents()

    # the row (in every warp), its statistics and the normed row, once a program
    r = gl.load(res_ptr + cols_g)
    summed = (gl.load(x_ptr + cols_g).to(r.dtype).to(gl.float32) + r.to(gl.float32)).to(r.dtype)
    if pid == 0:
        gl.store(new_res_ptr + cols_d, gl.convert_layout(summed, gl.SliceLayout(0, LD)))
        gl.store(next_sum_ptr + cols_d, gl.zeros([HC], gl.float32, gl.SliceLayout(0, LD)))
    sf = summed.to(gl.float32)
    rstd = 1.0 / gl.sqrt(gl.sum(sf * sf, axis=0) / H + eps)
    w = gl.load(norm_w_ptr + cols_g).to(gl.float32)
    normed = gl.expand_dims(((sf * rstd).to(r.dtype).to(gl.float32) * w).to(r.dtype).to(gl.float32), 0)

    out = gl.zeros([HC], gl.float32, gl.SliceLayout(0, LD))  # this program's share of the down product
    for b0 in range(start, end, BJ):
        j_next = b0 + BJ + rows_g
        offs_next = gl.expand_dims(j_next.to(gl.int64) * H, 1) + gl.expand_dims(cols_g, 0)
        mask_next = gl.expand_dims(j_next < end, 1) & cols_g_ok
        next_gate = gl.load(w_gate_up_ptr + offs_next, mask=mask_next, other=0.0)  # in flight meanwhile
        next_up = gl.load(w_gate_up_ptr + I * H + offs_next, mask=mask_next, other=0.0)
        j_d = b0 + rows_d
        down_w = gl.load(w_down_t_ptr + gl.expand_dims(j_d.to(gl.int64) * H, 1) + gl.expand_dims(cols_d, 0),
                         mask=gl.expand_dims(j_d < end, 1) & cols_d_ok, other=0.0)
        dtype = gate_w.dtype
        gate = gl.sum(gate_w.to(gl.float32) * normed, axis=1).to(dtype).to(gl.float32)  # rounded as a product's
        up = gl.sum(up_w.to(gl.float32) * normed, axis=1).to(dtype).to(gl.float32)
        act = gl.where(b0 + rows_g < end, gate / (1.0 + gl.exp(-gate)) * up, 0.0)
        act = gl.expand_dims(gl.convert_layout(act, gl.SliceLayout(1, LD)), 1)
        out += gl.sum(down_w.to(gl.float32) * act, axis=0)
        gate_w = next_gate
        up_w = next_up
    gl.atomic_add(sum_ptr + cols_d, out, sem="relaxed")


def usable(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    """Whether decode_mlp takes this kernel: `check` passed for the device and dtype, H = HIDDEN."""
    return hidden == HIDDEN and device.type == "cuda" and _CHECKED.get((device_index(device), dtype), False)


def check(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    """Once a (device, dtype), outside any CUDA graph: where Gluon is there, on Hopper or later, H =
    HIDDEN and BATCHGEN_GLUON_MLP is not 0, compile the kernel and compare it with the Triton kernel
    on random inputs (the same x + residual bit for bit, the sums within two bf16 roundings of the
    sum's scale). Any failure (an older or newer Gluon that does not compile it) leaves the Triton
    kernel in use. -> whether `usable` now says yes."""
    key = (device_index(device), dtype) if device.type == "cuda" and hidden == HIDDEN else None
    if key is not None and key not in _CHECKED:
        _CHECKED[key] = _passes(device, dtype, hidden)
    return usable(device, dtype, hidden)


def _passes(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    if (gluon is None or dtype not in (torch.float16, torch.bfloat16)
            or os.environ.get("BATCHGEN_GLUON_MLP", "1") == "0" or torch.cuda.get_device_capability(device)[0] < 9):
        return False
    from batchgen.kernels.decode_mlp import decode_mlp_triton

    gen = torch.Generator(device=device).manual_seed(0)
    inter = 1000  # (not a multiple of the block: partial blocks)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    w_gate_up, w_down_t = randn(2 * inter, hidden, scale=hidden**-0.5), randn(inter, hidden, scale=inter**-0.5)
    x, residual, norm_weight = randn(1, hidden), randn(1, hidden), 1 + randn(hidden, scale=0.1)
    sums = [torch.zeros(1, hidden, device=device) for _ in range(4)]
    try:
        got = decode_mlp_gluon(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t, sums[0], sums[1].fill_(1.0))
        want = decode_mlp_triton(x, residual, norm_weight, 1e-5, w_gate_up, w_down_t, sums[2], sums[3])
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 (a Gluon that cannot compile or run it: the Triton kernel stays)
        return False
    scale = sums[2].abs().max().item()
    return bool(torch.equal(got, want) and (sums[1] == 0).all()
                and torch.allclose(sums[0], sums[2], rtol=0.0, atol=2 * 2**-8 * scale))


def decode_mlp_gluon(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    w_gate_up: torch.Tensor, w_down_t: torch.Tensor, out_sum: torch.Tensor, next_sum: torch.Tensor,
) -> torch.Tensor:
    """kernels/decode_mlp.decode_mlp_triton's contract (H = HIDDEN, 16-bit)."""
    inter, hidden = w_down_t.shape
    assert hidden == HIDDEN and x.shape == residual.shape == (1, hidden)
    assert x.is_contiguous() and residual.is_contiguous()
    assert w_gate_up.shape == (2 * inter, hidden) and w_gate_up.is_contiguous() and w_down_t.is_contiguous()
    assert w_gate_up.dtype == w_down_t.dtype == residual.dtype == norm_weight.dtype
    assert out_sum.shape == next_sum.shape == (1, hidden) and out_sum.dtype == next_sum.dtype == torch.float32
    assert out_sum.data_ptr() != next_sum.data_ptr(), "a layer's sum is not the next one's"
    new_residual = torch.empty_like(residual)
    rows = triton.cdiv(inter, num_sms(x.device))
    _jitted()[(triton.cdiv(inter, rows),)](
        x, residual, new_residual, norm_weight, eps, w_gate_up, w_down_t, out_sum, next_sum, hidden, inter, rows,
        NW=NUM_WARPS, num_warps=NUM_WARPS, **pdl_launch_args(x.device),
    )
    return new_residual
