"""KV pool and scheduler on their own: budgets, preemption order, no leaked slot."""

from batchgen.engine.kv_slots import KVSlots
from batchgen.engine.request import Sequence
from batchgen.engine.scheduler import Scheduler
from batchgen.sampling_params import SamplingParams


def make_kv(slots, rows=8, max_len=64):
    return KVSlots(slots, rows)


def seq(i, prompt_len, max_tokens=4, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return Sequence(i, list(range(prompt_len)), params, [], {}, 0.0)


def run_step(sched, batch, token=7):
    """Pretend the model ran: every sequence whose chunk reached its end gets a token."""
    finished = []
    for s, start, n in zip(batch.seqs, batch.starts, batch.num_new):
        if start + n == s.num_tokens:
            s.token_ids.append(token)
            if s.num_generated >= s.params.max_tokens:
                sched.finish(s)
                finished.append(s)
    return finished


def drain(sched, check=lambda batch: None):
    done, steps = [], 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        check(batch)
        done += run_step(sched, batch)
        steps += 1
        assert steps < 10_000
    return done


def test_alloc_and_free_return_every_slot():
    kv = make_kv(10)
    a, b = kv.alloc(3), kv.alloc(7)
    assert kv.num_free == 0 and len(set(a) | set(b)) == 10
    kv.free(a)
    kv.free(b)
    assert kv.num_free == 10 and sorted(kv.free_slots) == list(range(10))


def test_budgets_are_respected_and_pool_is_whole_after():
    kv = make_kv(200)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=10)
    for i, n in enumerate([25, 3, 12, 1, 9, 30]):
        sched.add(seq(i, n))

    def check(batch):
        assert batch.num_tokens <= 10
        assert len(batch.seqs) <= 3
        assert all(n == 1 for n in batch.num_new[: batch.num_decode])
        assert len({s.id for s in batch.seqs}) == len(batch.seqs)

    done = drain(sched, check)
    assert sorted(s.id for s in done) == list(range(6))
    assert all(s.num_generated == 4 for s in done)
    assert kv.num_free == kv.num_slots and len(kv.free_rows) == 8


def test_long_prompt_is_prefilled_in_chunks_while_decodes_go_on():
    kv = make_kv(200)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    short, long = seq("short", 2, max_tokens=10), seq("long", 40)
    sched.add(short)
    sched.add(long)
    b = sched.schedule()
    assert b.seqs == [short, long] and b.num_new == [2, 6]
    run_step(sched, b)
    for _ in range(3):  # the short one decodes every step while the long prompt advances by 7
        b = sched.schedule()
        assert b.seqs[0] is short and b.num_new[0] == 1 and b.num_decode == 1
        assert b.seqs[1] is long and b.num_new[1] == 7
        run_step(sched, b)


def test_preemption_takes_the_newest_and_recomputes_it():
    # Requests that may stop at EOS are admitted on an estimate (half their max_tokens); here
    # neither stops early, so the pool (14) runs dry before both finish (9 slots each).
    kv = make_kv(14)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    old = seq("old", 4, max_tokens=6, ignore_eos=False)
    new = seq("new", 4, max_tokens=6, ignore_eos=False)
    sched.add(old)
    sched.add(new)
    done = drain(sched)
    assert {s.id for s in done} == {"old", "new"}
    assert old.num_preemptions == 0
    assert new.num_preemptions >= 1
    assert kv.num_free == kv.num_slots


def test_admission_waits_for_room_instead_of_overcommitting():
    kv = make_kv(20)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = seq("a", 6, max_tokens=8), seq("b", 6, max_tokens=8)  # each needs 14 of the 20 slots
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a]  # b would not fit beside a's expected growth
    run_step(sched, first)
    done = drain(sched)
    assert {s.id for s in done} == {"a", "b"} and a.num_preemptions == b.num_preemptions == 0


def test_a_token_still_in_flight_is_decoded_next_step_without_preemption():
    """The engine schedules step N+1 before reading back step N: a sequence whose last token is
    still on the device (pending) decodes it, and one whose final token is pending is left alone."""
    kv = make_kv(100)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    s = seq("s", 5, max_tokens=2)
    sched.add(s)
    first = sched.schedule()
    assert first.num_new == [5]
    s.num_pending = 1  # step 1 sampled a token, not read back yet
    second = sched.schedule()
    assert second.seqs == [s] and second.num_decode == 1 and second.starts == [5]
    assert s.num_preemptions == 0
    s.num_pending = 2  # step 2 sampled the final token (max_tokens=2): nothing more to run
    assert sched.schedule() is None and s.num_preemptions == 0 and sched.running == [s]


def test_packer_groups_shared_prefixes_and_puts_long_requests_first():
    from batchgen.engine.packer import pack

    shared = list(range(100, 140))
    seqs = [seq("short", 5, max_tokens=4), seq("long", 90, max_tokens=4)]
    seqs += [Sequence(f"p{i}", shared + [i] * (i + 1), SamplingParams(max_tokens=4), [], {}, 0.0) for i in range(3)]
    order = [s.id for s in pack(seqs)]
    assert order[0] == "long" and order[-1] == "short"
    assert order[1:4] == ["p2", "p1", "p0"]  # the shared-prefix group together, longest first
