"""Start-up timing of the products of 65 to 256 rows that the tile kernel can take (kernels/tile_gemm.py:
an MLP's gate/up with its SiLU-and-mul, o and down in split-K parts): for each product shape and each
row count a step graph or decode graph has there, cuBLAS or the fastest candidate tile, whichever the
GPU runs faster.

Why timing and not a rule: at these rows neither wins everywhere, and cuBLAS's own choice is uneven
from one row count to the next; those decode steps are most of a long job's.

How: one eager forward of the smallest such row count records which products ask the tile kernel
(tile_gemm.recording_products), with every layer's weight of each shape. For each shape, row count
and candidate, a CUDA graph of the product over all those weights (so W comes from DRAM, as in a
step) is replayed and timed with the kernel after it (a split tile's parts cost that add + RMSNorm
more to read). A tile is taken where it takes under MARGIN of cuBLAS's time. The choices are kept on disk per
GPU model and software versions ($BATCHGEN_CACHE/tuned_products.json): a machine times once, and
every later start makes the same choices (the same kernels, so the same results), in no time.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import torch
import triton

from batchgen.executor.cuda_graphs import batch_size_ladder, token_count_ladder
from batchgen.executor.warmup import reset_synthetic_rows, synthetic_batch
from batchgen.kernels import tile_gemm as tg
from batchgen.kernels.device import num_sms
from batchgen.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_parts
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.models.default_model import cache_root
from batchgen.version import __version__

log = logging.getLogger("batchgen")

MARGIN = 0.97  # a tile is taken under 97% of cuBLAS's time: closer is within the replays' spread
TIMING_BYTES = 256 << 20  # weights a timed graph reads (timing_weights)
TUNING = 2  # kept choices are timed again when this changes (the candidates, the tile kernel, the timing)


def tuned_sizes(max_num_seqs: int, max_tokens: int) -> list[int]:
    """The row counts the graphs run products at, between the tile kernel's fixed rule and its limit."""
    sizes = set(batch_size_ladder(max_num_seqs)) | set(token_count_ladder(max_tokens))
    return sorted(s for s in sizes if tg.MAX_ROWS < s <= tg.TUNED_MAX_ROWS)


def choose(cublas_us: float, tile_us: dict[tg.Tile, float]) -> tg.Tile | None:
    """The fastest tile where it takes under MARGIN of cuBLAS's us, else None (cuBLAS)."""
    best, best_us = None, cublas_us * MARGIN
    for tile, us in tile_us.items():
        if us < best_us:
            best, best_us = tile, us
    return best


def graph_time_us(fn, replays: int = 8, rounds: int = 3) -> float:
    """us the GPU takes for fn's work: the least mean over `rounds` of `replays` replays of a graph of it."""
    fn()  # (compiles, loads modules)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays)
    graph.reset()
    return best


def timing_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of the layers' weights that together pass TIMING_BYTES (at least two): enough that each
    comes from DRAM, as in a step, not from the L2 after the replay before (~50 MB on an H100/H200)."""
    count = max(2, -(-TIMING_BYTES // (weights[0].numel() * weights[0].element_size())))
    return weights[:count]


def time_choice(weights: list[torch.Tensor], m: int, silu_mul_out: bool, parts_ok: bool) -> tg.Tile | None:
    """choose() over graph replays of m rows times each weight (a layer's each; timing_weights'),
    cuBLAS against the candidate tiles, each with the kernel that follows it in a step: after cuBLAS's
    gate/up its SiLU-and-mul; after o and down (parts_ok) the add + RMSNorm, which sums a split tile's
    parts."""
    weights = timing_weights(weights)
    n, k = weights[0].shape
    n_out = n // 2 if silu_mul_out else n
    dev = dict(dtype=weights[0].dtype, device=weights[0].device)
    x, residual, norm_weight = torch.randn(m, k, **dev), torch.randn(m, n_out, **dev), torch.ones(n_out, **dev)

    def cublas():
        for w in weights:
            y = torch.mm(x, w.t())
            if silu_mul_out:
                silu_and_mul(y)
            elif parts_ok:
                add_rmsnorm(y, residual, norm_weight, 1e-6)

    def tiled(tile: tg.Tile):
        for w in weights:
            y = tg.tile_gemm_triton(x, w, silu_mul_out, parts_ok, tile)
            if parts_ok:
                (add_rmsnorm_parts if y.dim() == 3 else add_rmsnorm)(y, residual, norm_weight, 1e-6)

    cublas_us = graph_time_us(cublas) / len(weights)
    tiles = tg.candidate_tiles(m, n_out, k, silu_mul_out, num_sms(x.device))
    return choose(cublas_us, {tile: graph_time_us(functools.partial(tiled, tile)) / len(weights) for tile in tiles})


def choices_file() -> Path:
    return cache_root() / "tuned_products.json"


def machine_tag(device: torch.device) -> str:
    return (f"{torch.cuda.get_device_name(device)} | batchgen {__version__}.{TUNING} | torch {torch.__version__} | "
            f"cuda {torch.version.cuda} | triton {triton.__version__}")


def load_choices(path: Path) -> dict:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time again
        return {}
    return kept if isinstance(kept, dict) else {}


def save_choices(path: Path, kept: dict) -> None:
    """Write kept to path whole (a rank or process beside this one may write it too: last one wins)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=0, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not keep the tuned products in %s (%s): the next start times them again", path, e)


def is_choice(value) -> bool:
    """Whether a kept value is a choice: None (cuBLAS) or a tile, six positive integers."""
    return value is None or (isinstance(value, list) and len(value) == 6
                             and all(type(v) is int and v > 0 for v in value))


def tune_products(runner) -> None:
    """Fill tile_gemm.tuned for the runner's model (a ModelRunner on CUDA, its kernels warmed up),
    from the kept choices or by timing; before the CUDA graphs are captured (they hold the choice)."""
    sizes = tuned_sizes(runner.max_num_seqs, runner.max_num_batched_tokens)
    kv, dev = runner.kv, runner.device
    if not sizes or not tg.tile_gemm_supported(dev) or sizes[0] > kv.req_to_token.shape[1]:
        return
    with torch.inference_mode():
        # one prompt chunk of sizes[0] tokens: every product at that many rows
        with tg.recording_products() as products:
            fb = synthetic_batch(kv, dev, [], [(sizes[0], sizes[0])])
            fb.record_slots()
            runner.model(fb)
        reset_synthetic_rows(kv)
        if not products:
            return
        start, path, tag = time.perf_counter(), choices_file(), machine_tag(dev)
        kept, timed, taken = load_choices(path), 0, 0
        for shape, weights in products.items():
            silu_mul_out, parts_ok = shape[-2:]  # (tile_gemm.product_key: n, k, dtype, silu_mul_out, parts_ok)
            for m in sizes:
                key = (*shape, m)
                name = f"{tag} | {','.join(map(str, key))}"
                if not is_choice(kept.get(name, "")):  # not timed yet (or an entry no start wrote)
                    kept[name] = time_choice(list(weights.values()), m, silu_mul_out, parts_ok)
                    timed += 1
                tile = kept[name]
                tg.tuned[key] = tuple(tile) if tile else None
                taken += tile is not None
    if timed:
        save_choices(path, kept)
        log.info("timed %d products of %d-%d rows against cuBLAS in %.1fs: the tile kernel for %d of %d",
                 timed, sizes[0], sizes[-1], time.perf_counter() - start, taken, len(products) * len(sizes))
