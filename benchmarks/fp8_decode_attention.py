"""Decode attention over an fp8 KV pool against the bf16 pool on one GPU, at W-offline-like steps of
llama-3.1-8b and llama-3.2-1b: the tile the engine picks for each pool (kernels/decode_attention.pick_tile)
and the best of a sweep of tiles (BLOCK_N, warps, stages, programs an SM for the splits): microseconds, TB/s
of K/V read, and the largest error against the bf16 reference of the same (fp8-rounded) K/V.

    python benchmarks/fp8_decode_attention.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import time_us  # noqa: E402

from batchgen.kernels.decode_attention import (  # noqa: E402
    _decode_attention_launch,
    decode_attention_ref,
    pick_num_splits,
    pick_tile,
)
from batchgen.kernels.device import num_sms  # noqa: E402

SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64)}  # q heads, kv heads, head_dim


def main():
    gpu = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, (hq, hk, d) in SHAPES.items():
        for batch, kv_len in [(64, 1024), (256, 1024), (256, 2048)]:
            slots = batch * kv_len
            k = torch.randn(slots, hk, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            v = torch.randn(slots, hk, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            kr, vr = k8.to(torch.bfloat16), v8.to(torch.bfloat16)  # what the fp8 pool holds
            q = torch.randn(batch, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            table = torch.randperm(slots, device="cuda", generator=gen).int().view(batch, kv_len)
            rows = torch.arange(batch, device="cuda", dtype=torch.int32)
            lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
            scale = d ** -0.5
            sms = num_sms(q.device)
            ref = decode_attention_ref(q, kr, vr, table, rows, lens, kv_len, scale).float()
            line = {"gpu": gpu, "model": model, "batch": batch, "kv_len": kv_len}
            for name, (kc, vc) in {"bf16": (k, v), "fp8": (k8, v8), "fp8_contiguous_slots": (k8, v8)}.items():
                if name == "fp8_contiguous_slots":  # each sequence's slots in a row (random above)
                    table = torch.arange(slots, device="cuda", dtype=torch.int32).view(batch, kv_len)
                    ref = decode_attention_ref(q, kr, vr, table, rows, lens, kv_len, scale).float()
                kv_bytes = 2 * slots * hk * d * kc.element_size()
                picked = (*pick_tile(q.dtype, d, batch * hk, sms, kc.dtype), 2)  # (pick_num_splits' default)
                tiles = [picked] + [(bn, w, st, per_sm) for bn in (32, 64, 128) for w in (1, 2, 4) for st in (2, 3)
                                    for per_sm in (1, 2, 4)]
                for i, (bn, w, st, per_sm) in enumerate(tiles):
                    splits = pick_num_splits(batch, hk, kv_len, bn, sms, per_sm)

                    def fn():
                        return _decode_attention_launch(q, kc, vc, table, rows, lens, kv_len, scale, splits, bn, w, st)
                    try:
                        us = time_us(fn, calls=20)
                    except Exception as e:  # (a tile that does not fit)
                        line[f"{name}_{bn}_{w}_{st}_error"] = str(e)[:80]
                        continue
                    err = (fn().float() - ref).abs().max().item()
                    result = {"us": round(us, 1), "tile": [bn, w, st, per_sm], "splits": splits,
                              "TBps": round(kv_bytes / us / 1e6, 2), "max_err": round(err, 4)}
                    if i == 0:
                        line[f"{name}_picked"] = result
                    if us < line.get(f"{name}_best", {}).get("us", float("inf")):
                        line[f"{name}_best"] = result
            print(json.dumps(line), flush=True)
            del k, v, k8, v8, kr, vr


if __name__ == "__main__":
    main()
