import pytest
import torch

from batchgen.kernels.decode_attention import _decode_attention_launch, decode_attention_ref
from batchgen.kernels.longest_first import longest_first, longest_first_ref, longest_first_triton
from tests.kernels.attention_batch import make_batch


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 64, 65, 130])
def test_longest_first_is_a_stable_descending_argsort(device, num_seqs):
    """Every sequence once, longest first, ties in index order (across the kernel's blocks of 64, with
    many equal lengths: values from a small range), each with its own length and row."""
    gen = torch.Generator().manual_seed(num_seqs)
    kv_lens = torch.randint(0, 9, (num_seqs,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(1000, generator=gen)[:num_seqs].to(torch.int32)
    schedule = longest_first_triton(kv_lens.to(device), rows.to(device)).cpu()
    order = torch.argsort(kv_lens, descending=True, stable=True)
    assert schedule.tolist() == [order.tolist(), kv_lens[order].tolist(), rows[order].tolist()]
    assert torch.equal(schedule, longest_first_ref(kv_lens, rows))


def test_longest_first_writes_into_out(device):
    kv_lens = torch.tensor([3, 900, 17, 900, 1], dtype=torch.int32, device=device)
    rows = torch.tensor([7, 8, 9, 10, 11], dtype=torch.int32, device=device)
    out = torch.full((3, 5), -1, dtype=torch.int32, device=device)
    assert longest_first(kv_lens, rows, out=out) is out
    assert out.tolist() == [[1, 3, 2, 0, 4], [900, 900, 17, 3, 1], [8, 10, 9, 7, 11]]
    assert longest_first(kv_lens[:0], rows[:0]).shape == (3, 0)


def test_decode_attention_does_not_depend_on_the_order_given(device, assert_close):
    """The schedule only orders the programs: any order of the sequences gives each its own output."""
    lens = [5, 97, 1, 64, 13, 40]
    batch = make_batch([(1, n) for n in lens], 4, 2, 32, torch.float32, device, seed=3)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_rows, batch.kv_lens, 97, 0.2)
    want = decode_attention_ref(*args)
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], None):
        schedule = None
        if order is not None:
            order = torch.tensor(order, device=device)
            schedule = torch.stack([order.to(torch.int32), batch.kv_lens[order], batch.req_rows[order]])
        assert_close(_decode_attention_launch(*args, 2, 16, 2, 2, schedule), want)
