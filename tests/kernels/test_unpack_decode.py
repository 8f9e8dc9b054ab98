import random

import pytest
import torch

from batchgen.executor.step_inputs import FIELDS, SCALARS, StepInputs
from batchgen.kernels.unpack_decode import unpack_decode_ref, unpack_decode_triton


def decode_step(n, pending, rng):
    """A decode-only step's packed inputs (as runner.step_inputs packs one): n decodes, the ones in
    `pending` still being sampled by the step in flight (src: their row of its tokens)."""
    rows = rng.sample(range(300), n)
    positions = [rng.randrange(1, 60) for _ in range(n)]
    slots = [rng.randrange(0, 500) for _ in range(n)]
    dst = sorted(pending)
    src = rng.sample(range(300), len(dst))
    ids = [0 if i in pending else rng.randrange(1, 1000) for i in range(n)]
    arrays = {f: [] for f in FIELDS}
    arrays.update(input_ids=ids, positions=positions, out_slots=slots, logits_indices=list(range(n)),
                  pending_dst=dst, pending_src=src, token_rows=rows, rows=rows, kv_lens=[p + 1 for p in positions],
                  cu_q=list(range(n + 1)))
    return StepInputs.pack([n, n, max(positions) + 1 if n else 0, 0, 0], [arrays[f] for f in FIELDS]).packed


@pytest.mark.parametrize("size,n,pending", [(1, 1, {0}), (1, 1, set()), (5, 3, {0, 2}), (16, 16, set(range(16))),
                                            (32, 20, {1, 4, 5, 19}), (8, 0, set()),
                                            (256, 200, set(random.Random(1).sample(range(200), 100)))])
def test_unpack_decode_matches_reference(device, size, n, pending):
    rng = random.Random(size * 100 + n)
    packed = torch.cat([decode_step(n, pending, rng), torch.full((7,), -5)]).to(device)  # (a static buffer's tail)
    last_tokens = torch.arange(1000, 1300, device=device)
    outs = []
    for fn in (unpack_decode_triton, unpack_decode_ref):
        bufs = [torch.full((size,), -1, dtype=dt, device=device) for dt in (torch.int64,) * 3 + (torch.int32,) * 2]
        table = torch.zeros(301, 64, dtype=torch.int32, device=device)
        fn(packed, last_tokens, *bufs, table, 499, 300, len(SCALARS), FIELDS)
        outs.append(bufs + [table])
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    ids, positions, slots, rows, lens, table = outs[1]
    assert ids[n:].eq(0).all() and slots[n:].eq(499).all() and rows[n:].eq(300).all() and lens[n:].eq(1).all()
    assert all(1000 <= ids[i] < 1300 for i in pending) and all(ids[i] < 1000 for i in range(n) if i not in pending)
    assert table.count_nonzero() <= n
