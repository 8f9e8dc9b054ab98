"""kernels/decode_mlp.py's one-row MLP (same contract and rounding), H = 2,048, as a persistent Gluon kernel.

    P = min(the SM count, I / BJ);  program p owns the blocks p, p + P, p + 2P, ... of BJ = 8 rows

A block is three tiles [BJ, H]: its gate rows, up rows and rows of W_down^T, copied by TMA into a ring
of TILES slots of shared memory (one mbarrier a slot); the first tiles are issued before the PDL wait
and each slot is refilled once every warp has read it. A warp sums one gate/up row; a thread holds a
column group of all BJ rows of W_down^T, so the down product's sum over a block stays in the thread,
and the program adds its [H] share into `sum` once (fp32 atomics). The same ring serves one-row
products whose weight fits it whole (`row_product_gluon`, where `row_product_takes` says so).

Gluon is experimental: each kernel is checked against the Triton one once a device (the MLP's at
start-up, the row product's at its first call outside graph capture); a failure leaves the Triton one.
"""
from __future__ import annotations

import functools

import torch
import triton

from batchgen.kernels.decode_mlp import decode_mlp_triton
from batchgen.kernels.device import device_index, num_sms, pdl_launch_args
from batchgen.kernels.skinny_gemm import skinny_gemm_triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra import cuda as cuda_extra

    # (Triton 3.6's names, renamed later)
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except Exception:  # noqa: BLE001 (a Triton without Gluon, or with another one: the Triton kernel)
    gluon = None

HIDDEN = 2048  # H taken: 256 columns a warp-row times NUM_WARPS, one column group a thread
NUM_WARPS = 8  # = BJ, the rows of a block (one a warp)
# The shared-memory ring, in tiles of [BJ, H] (32 KB at 16 bits): 7 fill 224 of an H100's or H200's 227 KB
TILES = 7
TMA_COLS = 256  # a weight row is read as H / 256 rows of 256 (a TMA box side is at most 256)
_CHECKED: dict[tuple[int, torch.dtype], bool] = {}  # (device index, dtype) -> check passed


@functools.cache
def _jit_helpers() -> None:
    """The kernels' helpers, jitted at the first launch of either kernel (in the checks' try): an
    experimental API that another Triton may reject must not fail the import of batchgen."""
    for helper in (_ring, _release_slots, _issue_tile, _refill, _slot_rows, _issue_row_tile):
        globals()[helper.__name__] = gluon.jit(helper)


@functools.cache
def _jitted():
    """The MLP kernel, jitted as its helpers are (`_jit_helpers`)."""
    _jit_helpers()
    return gluon.jit(do_not_specialize=["eps"])(_decode_mlp_gluon_kernel)


@functools.cache
def _jitted_row_product():
    """The row product's kernel, jitted as its helpers are (`_jit_helpers`)."""
    _jit_helpers()
    return gluon.jit(_row_product_gluon_kernel)


def _ring(desc, NT: gl.constexpr):
    """NT slots of desc's box in shared memory, and an mbarrier a slot (initialized: one arrival, the
    TMA's byte count)."""
    ring = gl.allocate_shared_memory(desc.dtype, [NT] + desc.block_type.shape, desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NT):
        mbarrier.init(bars.index(i), count=1)
    cta_barrier()
    return ring, bars


def _release_slots():
    """Order every warp's reads of the ring before the TMA writes that refill it: a CTA barrier, then the
    async proxy's fence."""
    cta_barrier()
    fence_async_shared()


def _issue_tile(gate_desc, up_desc, down_desc, ring, bars, b, T: gl.constexpr, NT: gl.constexpr, pid, P, blocks):
    """The TMA load of tile 3 b + T (the program's block b + T // 3; its gate, up or W_down^T rows as T
    % 3 is 0, 1 or 2) into ring slot (3 b + T) % NT, counted on that slot's barrier; none past the
    program's last block."""
    k = b + T // 3
    slot = (3 * b + T) % NT
    bar = bars.index(slot)
    pred = k < blocks
    mbarrier.expect(bar, gate_desc.block_type.nbytes, pred=pred)
    coord = (pid + k * P) * gate_desc.block_type.shape[0]  # block pid + k P: BJ weight rows, 8 BJ of the view
    if T % 3 == 0:
        tma_load(gate_desc, [coord, 0], bar, ring.index(slot), pred=pred)
    elif T % 3 == 1:
        tma_load(up_desc, [coord, 0], bar, ring.index(slot), pred=pred)
    else:
        tma_load(down_desc, [coord, 0], bar, ring.index(slot), pred=pred)


def _refill(gate_desc, up_desc, down_desc, ring, bars, b, T: gl.constexpr, NT: gl.constexpr, pid, P, blocks):
    """Once every warp has read tile 3 b + T - NT, its slot's next tile 3 b + T."""
    _release_slots()
    _issue_tile(gate_desc, up_desc, down_desc, ring, bars, b, T, NT, pid, P, blocks)


def _slot_rows(ring, bars, t, NT: gl.constexpr, BJ: gl.constexpr, HC: gl.constexpr):
    """Tile t once it has landed: ring slot t % NT, a TMA box of [BJ H / 256, 256] unswizzled, as the
    row-major [BJ, H] it also is."""
    mbarrier.wait(bars.index(t % NT), (t // NT) & 1)
    ROW_MAJOR: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    slot = ring.index(t % NT)
    if hasattr(slot, "reinterpret"):  # (Triton 3.6's name: _reinterpret)
        rows = slot.reinterpret(slot.dtype, [BJ, HC], ROW_MAJOR)
    else:
        rows = slot._reinterpret(slot.dtype, [BJ, HC], ROW_MAJOR)
    return rows


def _decode_mlp_gluon_kernel(
    x_ptr, res_ptr, new_res_ptr, norm_w_ptr, eps, gate_desc, up_desc, down_desc, sum_ptr, next_sum_ptr,
    H, I,  # (arguments as kernels/decode_mlp.py's)
    NW: gl.constexpr,  # warps = rows of a block
    NT: gl.constexpr,  # tiles in the shared-memory ring
    PDL: gl.constexpr,  # launched with programmatic dependent launch (kernels/device.py)
):
    BJ: gl.constexpr = NW
    HC: gl.constexpr = 256 * NW  # == H
    # gate/up blocks [BJ, H]: a row a warp, 8 contiguous columns a thread
    LG: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    # W_down^T blocks [BJ, H]: every row of 8 contiguous columns in one thread
    LD: gl.constexpr = gl.BlockedLayout([BJ, 8], [1, 32], [1, NW], [1, 0])
    dtype: gl.constexpr = gate_desc.dtype
    ring, bars = _ring(gate_desc, NT)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    blocks = gl.cdiv(gl.cdiv(I, BJ) - pid, P)  # the program's blocks: pid, pid + P, ... (BJ rows each)
    for T in gl.static_range(NT):  # the first tiles before the PDL wait (weights: no dependency)
        _issue_tile(gate_desc, up_desc, down_desc, ring, bars, 0, T, NT, pid, P, blocks)
    if PDL:  # kernels/device.py's wait_for_prior_kernels
        cuda_extra.gdc_wait()
        cuda_extra.gdc_launch_dependents()

    rows_g = gl.arange(0, BJ, layout=gl.SliceLayout(1, LG))
    cols_g = gl.arange(0, HC, layout=gl.SliceLayout(0, LG))
    cols_d = gl.arange(0, HC, layout=gl.SliceLayout(0, LD))
    # the row (in every warp), its statistics and the normed row, once a program
    r = gl.load(res_ptr + cols_g)
    summed = (gl.load(x_ptr + cols_g).to(r.dtype).to(gl.float32) + r.to(gl.float32)).to(r.dtype)
    if pid == 0:  # (in the row's own layout: no shared-memory scratch, the ring takes it all)
        gl.store(new_res_ptr + cols_g, summed)
        gl.store(next_sum_ptr + cols_g, gl.zeros([HC], gl.float32, gl.SliceLayout(0, LG)))
    sf = summed.to(gl.float32)
    rstd = 1.0 / gl.sqrt(gl.sum(sf * sf, axis=0) / H + eps)
    w = gl.load(norm_w_ptr + cols_g).to(gl.float32)
    normed = gl.expand_dims(((sf * rstd).to(r.dtype).to(gl.float32) * w).to(r.dtype).to(gl.float32), 0)

    out = gl.zeros([HC], gl.float32, gl.SliceLayout(0, LD))  # this program's share of the down product
    for b in range(blocks):
        # each slot refilled as soon as every warp has read it (not the block's three together)
        gate_w = _slot_rows(ring, bars, 3 * b, NT, BJ, HC).load(LG)
        _refill(gate_desc, up_desc, down_desc, ring, bars, b, NT, NT, pid, P, blocks)
        up_w = _slot_rows(ring, bars, 3 * b + 1, NT, BJ, HC).load(LG)
        _refill(gate_desc, up_desc, down_desc, ring, bars, b, NT + 1, NT, pid, P, blocks)
        down_w = _slot_rows(ring, bars, 3 * b + 2, NT, BJ, HC).load(LD)
        _refill(gate_desc, up_desc, down_desc, ring, bars, b, NT + 2, NT, pid, P, blocks)
        gate = gl.sum(gate_w.to(gl.float32) * normed, axis=1).to(dtype).to(gl.float32)  # rounded as a product's
        up = gl.sum(up_w.to(gl.float32) * normed, axis=1).to(dtype).to(gl.float32)
        act = gl.where((pid + b * P) * BJ + rows_g < I, gate / (1.0 + gl.exp(-gate)) * up, 0.0)
        act = gl.expand_dims(gl.convert_layout(act, gl.SliceLayout(1, LD)), 1)
        out += gl.sum(down_w.to(gl.float32) * act, axis=0)
    gl.atomic_add(sum_ptr + cols_d, out, sem="relaxed")


def _issue_row_tile(w_desc, ring, bars, k, NT: gl.constexpr, pid, P, blocks):
    """The TMA load of the program's block k (rows (pid + k P) BJ + [0, BJ) of W) into slot k % NT."""
    slot = k % NT
    bar = bars.index(slot)
    pred = k < blocks
    mbarrier.expect(bar, w_desc.block_type.nbytes, pred=pred)
    tma_load(w_desc, [(pid + k * P) * w_desc.block_type.shape[0], 0], bar, ring.index(slot), pred=pred)


def _row_product_gluon_kernel(x_ptr, w_desc, y_ptr, N, NW: gl.constexpr, NT: gl.constexpr, PDL: gl.constexpr):
    """y [N] = W [N, H] @ x [H] (fp32 sums, rounded once to y's dtype): blocks of BJ = NW rows (a row a
    warp) dealt round-robin over the programs, through a ring of NT tiles of which the program issues
    all it can before its PDL wait (for the weights where NT covers a program's every block)."""
    BJ: gl.constexpr = NW
    HC: gl.constexpr = 256 * NW  # == H
    LG: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    ring, bars = _ring(w_desc, NT)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    blocks = gl.cdiv(gl.cdiv(N, BJ) - pid, P)
    for k in gl.static_range(NT):
        _issue_row_tile(w_desc, ring, bars, k, NT, pid, P, blocks)
    if PDL:
        cuda_extra.gdc_wait()
        cuda_extra.gdc_launch_dependents()
    rows = gl.arange(0, BJ, layout=gl.SliceLayout(1, LG))
    x = gl.expand_dims(gl.load(x_ptr + gl.arange(0, HC, layout=gl.SliceLayout(0, LG))).to(gl.float32), 0)
    for b in range(blocks):
        w = _slot_rows(ring, bars, b, NT, BJ, HC).load(LG)
        _release_slots()
        _issue_row_tile(w_desc, ring, bars, b + NT, NT, pid, P, blocks)
        n = (pid + b * P) * BJ + rows
        gl.store(y_ptr + n, gl.sum(w.to(gl.float32) * x, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def _gluon_allowed(device: torch.device) -> bool:
    """What both checks need before they compile: Gluon here, a Hopper or later GPU."""
    return gluon is not None and torch.cuda.get_device_capability(device)[0] >= 9


_ROW_CHECKED: dict[tuple[int, torch.dtype], bool] = {}  # (device index, dtype) -> the row product's check passed


def row_product_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a one-row product x [1, H] @ W^T goes to row_product_gluon: H = HIDDEN, 16-bit, a weight
    TMA can read (contiguous, 16-byte aligned) whose every block fits the ring (at most TILES blocks of
    8 rows an SM: llama-3.2-1b's o), and the check passed (run here, once a device and dtype, outside
    CUDA graph capture)."""
    n, k = weight.shape
    if not (x.is_cuda and k == HIDDEN and x.shape == (1, k) and weight.dtype == x.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and x.is_contiguous() and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and triton.cdiv(n, NUM_WARPS) <= TILES * num_sms(x.device)):
        return False
    key = (device_index(x.device), x.dtype)
    if key not in _ROW_CHECKED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _ROW_CHECKED[key] = _row_passes(x.device, x.dtype)
    return _ROW_CHECKED[key]


def _row_passes(device: torch.device, dtype: torch.dtype) -> bool:
    """Compiled and compared with the skinny kernel on random inputs (within 1e-4 of the scale: fp32
    sums in another order); any failure leaves the skinny kernel."""
    if not _gluon_allowed(device):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=gen, device=device).to(dtype)
    w = (torch.randn(1000, HIDDEN, generator=gen, device=device) * HIDDEN**-0.5).to(dtype)
    try:
        got = row_product_gluon(x, w, torch.float32)
        want = skinny_gemm_triton(x, w, out_dtype=torch.float32)
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 (a Gluon that cannot compile or run it: the skinny kernel stays)
        return False
    return bool(torch.allclose(got, want, rtol=0.0, atol=1e-4 * want.abs().max().item()))


def row_product_gluon(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, H] @ weight [N, H]^T -> [1, N] in out_dtype (default x's), into out when given; the ring
    sized to the program's blocks (at most TILES)."""
    n = weight.shape[0]
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.dtype == (out_dtype or x.dtype) and y.is_contiguous()
    blocks, programs = _blocks_and_programs(n, x.device)
    _jitted_row_product()[(programs,)](x, _rows_descriptor(weight), y, n, NW=NUM_WARPS,
                                       NT=min(TILES, triton.cdiv(blocks, programs)), num_warps=NUM_WARPS,
                                       **pdl_launch_args(x.device))
    return y


def usable(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    """Whether decode_mlp takes this kernel: `check` passed for the device and dtype, H = HIDDEN."""
    return hidden == HIDDEN and device.type == "cuda" and _CHECKED.get((device_index(device), dtype), False)


def check(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    """Once a (device, dtype), outside any CUDA graph: where Gluon is there, on Hopper or later, H =
    HIDDEN, compile the kernel and compare it with the Triton kernel
    on random inputs (the same x + residual bit for bit, the sums within two bf16 roundings of the
    sum's scale). Any failure (an older or newer Gluon that does not compile it) leaves the Triton
    kernel in use. -> whether `usable` now says yes."""
    key = (device_index(device), dtype) if device.type == "cuda" and hidden == HIDDEN else None
    if key is not None and key not in _CHECKED:
        _CHECKED[key] = _passes(device, dtype, hidden)
    return usable(device, dtype, hidden)


def _passes(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    if dtype not in (torch.float16, torch.bfloat16) or not _gluon_allowed(device):
        return False
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
    gate_desc, up_desc, down_desc = _descriptors(w_gate_up, w_down_t)
    _jitted()[(_blocks_and_programs(inter, x.device)[1],)](
        x, residual, new_residual, norm_weight, eps, gate_desc, up_desc, down_desc, out_sum, next_sum, hidden, inter,
        NW=NUM_WARPS, NT=TILES, num_warps=NUM_WARPS, **pdl_launch_args(x.device),
    )
    return new_residual


def _blocks_and_programs(rows: int, device: torch.device) -> tuple[int, int]:
    """Both kernels' grid: the blocks of NUM_WARPS rows, and a program an SM at most (the kernels deal
    the blocks round-robin over the programs)."""
    blocks = triton.cdiv(rows, NUM_WARPS)
    return blocks, min(num_sms(device), blocks)


def _descriptors(w_gate_up: torch.Tensor, w_down_t: torch.Tensor):
    """TMA descriptors of the gate rows, the up rows and W_down^T (`_rows_descriptor`)."""
    inter = w_down_t.shape[0]
    return tuple(_rows_descriptor(w) for w in (w_gate_up[:inter], w_gate_up[inter:], w_down_t))


def _rows_descriptor(weight: torch.Tensor):
    """The TMA descriptor of a weight [N, H] viewed as rows of 256 (a block of BJ weight rows is one
    box of [8 BJ, 256]: one contiguous 32 KB at 16 bits, unswizzled in shared memory)."""
    box = [HIDDEN // TMA_COLS * NUM_WARPS, TMA_COLS]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * weight.element_size(), rank=2)
    return TensorDescriptor.from_tensor(weight.reshape(-1, TMA_COLS), box, layout)
