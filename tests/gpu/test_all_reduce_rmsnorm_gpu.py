"""On two GPUs: the all-reduce + residual add + RMSNorm kernel (kernels/all_reduce_rmsnorm.py) as the
engine calls it (TensorParallel.all_reduce_add_rmsnorm on partial sums a product wrote into the
symmetric buffer).

- Every row of the normed output, on both ranks, is bit for bit what the separate path gives (the sum
  in rank order, NCCL's on two ranks, then kernels/rmsnorm.py's add + RMSNorm), and close to the
  torch reference; the residual is the reference's on the rank's own rows.
- Both forms: two-shot (the sums' buffer) and one-shot (the norm's own alternating buffers, a decode
  step's sizes; there the residual is right on every row).
- Calls of different row counts back to back (the flags and buffers are reused: a stale flag would
  hang or give wrong rows), and CUDA graphs replayed with new inputs: one call, and one-shot calls back
  to back with the products' writes between them, as a step's graph holds them.
"""
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from batchgen.kernels.all_reduce_rmsnorm import all_reduce_add_rmsnorm_ref
from batchgen.kernels.rmsnorm import add_rmsnorm_triton
from batchgen.parallel.symmetric_all_reduce import ONE_SHOT_BYTES
from batchgen.parallel.tensor_parallel import connect

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

SHAPES = [(1, 4096), (3, 4096), (7, 2048), (130, 896), (256, 4096), (2, 64)]  # rows, hidden
EPS = 1e-5


def _inputs(tp, rows, hidden, gen, for_norm=False):
    """Each rank's own partial sums (written where a product writes them), and a residual and weight
    that every rank shares."""
    partial = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    shared = torch.Generator(device="cuda").manual_seed(rows * 7919 + hidden)
    residual = torch.randn(rows, hidden, generator=shared, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=shared, device="cuda")).to(torch.bfloat16)
    staged = tp.reduce_buffer(rows, hidden, torch.bfloat16, for_norm)
    one_shot = for_norm and rows * hidden * 2 <= ONE_SHOT_BYTES
    assert (staged.data_ptr() == tp.symmetric.buffer.data_ptr()) != one_shot
    staged.copy_(partial)
    assert tp.defers_sum(staged)
    return staged, partial, residual, weight


def _check(tp, rank, partial, residual_before, residual, normed, weight, every_row=False):
    parts = torch.empty(tp.size, *partial.shape, dtype=partial.dtype, device="cuda")
    tp.group.allgather([list(parts.unbind(0))], [partial]).wait()
    summed = parts.float().cumsum(0)[-1].to(partial.dtype)  # rank order in fp32, one rounding
    if tp.size == 2:  # (two ranks: NCCL's sum has the same single rounding)
        nccl = partial.clone()
        tp.group.allreduce([nccl]).wait()
        assert torch.equal(nccl, summed)
    expected, expected_residual = add_rmsnorm_triton(summed, residual_before, weight, EPS)
    assert torch.equal(normed, expected), partial.shape
    ref, ref_residual = all_reduce_add_rmsnorm_ref(list(parts), residual_before, weight, EPS)
    torch.testing.assert_close(normed, ref, atol=2e-2, rtol=2e-2)
    share = -(-partial.shape[0] // tp.size)
    mine = slice(None) if every_row else slice(rank * share, (rank + 1) * share)
    assert torch.equal(residual[mine], expected_residual[mine]) and torch.equal(residual[mine], ref_residual[mine])


def _rank(rank, world, store_path):
    torch.cuda.set_device(rank)
    tp = connect(store_path, rank, world, torch.device("cuda", rank))
    assert tp.symmetric is not None, "GPUs with peer access should use symmetric memory"
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    for for_norm in (False, True):  # two-shot only, then one-shot where the sums are small
        for rows, hidden in SHAPES + SHAPES[::-1]:  # back to back, the grid growing and shrinking
            staged, partial, residual_before, weight = _inputs(tp, rows, hidden, gen, for_norm)
            residual = residual_before.clone()
            normed, out_residual = tp.all_reduce_add_rmsnorm(staged, residual, weight, EPS)
            assert out_residual is residual
            _check(tp, rank, partial, residual_before, residual, normed, weight,
                   every_row=for_norm and rows * hidden * 2 <= ONE_SHOT_BYTES)

    _one_shot_graph(tp, rank, gen)
    rows, hidden = 64, 4096  # captured once, replayed with new partial sums and residuals
    staged, partial, residual_before, weight = _inputs(tp, rows, hidden, gen)
    residual = residual_before.clone()
    tp.all_reduce_add_rmsnorm(staged, residual.clone(), weight, EPS)  # (compiled off the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, _ = tp.all_reduce_add_rmsnorm(staged, residual, weight, EPS)
    for replay in range(3):
        partial = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        shared = torch.Generator(device="cuda").manual_seed(100 + replay)  # (the same residual on both ranks)
        residual_before = torch.randn(rows, hidden, generator=shared, device="cuda", dtype=torch.bfloat16)
        staged.copy_(partial)
        residual.copy_(residual_before)
        graph.replay()
        _check(tp, rank, partial, residual_before, residual, normed, weight)
    torch.cuda.synchronize()
    graph.reset()
    tp.close_symmetric()


def _one_shot_graph(tp, rank, gen, calls=3, rows=16, hidden=2048):
    """One-shot calls back to back in one graph, each after a product's write into the buffer staged for it
    (the two alternate), replayed with new partial sums: every call's rows right each time."""
    weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    partials = [torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(calls)]
    residuals = [torch.empty_like(p) for p in partials]
    outs = [torch.empty_like(p) for p in partials]

    def step():
        for partial, residual, out in zip(partials, residuals, outs):
            staged = tp.reduce_buffer(rows, hidden, torch.bfloat16, for_norm=True)
            staged.copy_(partial)  # (the product)
            out.copy_(tp.all_reduce_add_rmsnorm(staged, residual, weight, EPS)[0])

    step()  # (compiled off the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        shared = torch.Generator(device="cuda").manual_seed(200 + replay)
        befores = []
        for partial, residual in zip(partials, residuals):
            partial.copy_(torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16))
            befores.append(torch.randn(rows, hidden, generator=shared, device="cuda", dtype=torch.bfloat16))
            residual.copy_(befores[-1])
        graph.replay()
        for partial, before, residual, out in zip(partials, befores, residuals, outs):
            _check(tp, rank, partial, before, residual, out, weight, every_row=True)
    torch.cuda.synchronize()
    graph.reset()


def test_all_reduce_add_rmsnorm_equals_separate_kernels():
    world = 2  # (the engine fuses at two ranks only: forward/symmetric_all_reduce.FUSED_NORM_RANKS)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, str(Path(tmp) / "store")), nprocs=world)
