import pytest
import torch

from batchgen.executor.staging import Staging

SPIN = 50_000_000  # cycles of torch.cuda._sleep: ~25 ms, long enough for a copy that did not wait to run first


def test_cpu_copies_are_the_tensors_themselves():
    staging = Staging(torch.device("cpu"), 16)
    out = torch.zeros(8, dtype=torch.int64)
    staging.to_static(torch.arange(5), out)
    assert out.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    x = torch.arange(3)
    hosts, event = staging.to_host([x])
    assert hosts[0] is x and event is None


@pytest.mark.gpu
def test_static_copy_waits_for_the_buffer_s_last_reader():
    """The next step's inputs are copied on a side stream, but only once the kernel that read the buffer
    before (marked by static_read) is done; the step's stream waits for the copy."""
    staging = Staging(torch.device("cuda"), 64)
    buf = torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the step before, still running
    seen = buf * 1  # the graph's unpacking: reads the buffer
    staging.static_read()
    staging.next_step()
    staging.to_static(torch.full((8,), 7), buf)
    after = buf * 1  # the next step's first kernel: must see the new values
    torch.cuda.synchronize()
    assert seen.tolist() == list(range(8))
    assert after.tolist() == [7] * 8


@pytest.mark.gpu
def test_static_copy_waits_for_this_step_s_reader_not_an_earlier_one():
    """static_read records one event again each step: the copy waits for the latest reader (a step
    whose reader is still queued behind a long kernel), not for the step before's, long done."""
    staging = Staging(torch.device("cuda"), 64)
    buf = torch.arange(8, device="cuda")
    seen = []
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN)
        seen.append(buf * 1)
        staging.static_read()
        staging.next_step()
        staging.to_static(torch.full((8,), 10 + step), buf)
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [list(range(8)), [10] * 8, [11] * 8]
    assert buf.tolist() == [12] * 8


@pytest.mark.gpu
def test_results_are_copied_back_once_produced():
    """Results are copied on the copy-out stream after the step's stream produced them; the event says
    when the host copies may be read."""
    staging = Staging(torch.device("cuda"), 64)
    x = torch.arange(6, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    tokens, values = x + 1, (x * 2).float()
    hosts, event = staging.to_host([tokens, values])
    del tokens, values  # (their memory must not be reused before the copies ran: record_stream)
    torch.empty(6, dtype=torch.int64, device="cuda").fill_(-1)
    event.synchronize()
    assert hosts[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert hosts[1].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
