import pytest
import torch

from batchgen.kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton


def expected(logits, bitmask, rows):
    """Bit by bit, in plain Python: the op's definition."""
    out = logits.clone()
    for c, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[c, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


# (rows of logits, vocab, bitmask words): vocab not a multiple of 32; a bitmask narrower than the
# vocab (a padded LM head); one row.
@pytest.mark.parametrize("num_logits,vocab,words", [(5, 70, 3), (1, 33, 2), (4, 100, 2)])
def test_token_bitmask(device, num_logits, vocab, words):
    torch.manual_seed(0)
    logits = torch.randn(num_logits, vocab, device=device)
    rows = torch.tensor([r for r in (3, 0, 4) if r < num_logits], dtype=torch.int64, device=device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, device=device)
    bitmask[0, 0] = -1  # every bit set, the sign bit too
    want = expected(logits.cpu(), bitmask.cpu(), rows.cpu())
    got_triton, got_ref = logits.clone(), logits.clone()
    apply_token_bitmask_triton(got_triton, bitmask, rows)
    apply_token_bitmask_ref(got_ref, bitmask, rows)
    assert torch.equal(got_triton.cpu(), want)
    assert torch.equal(got_ref.cpu(), want)
