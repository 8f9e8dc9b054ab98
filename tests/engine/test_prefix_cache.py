"""The prefix cache on its own (radix tree, references, LRU eviction) and under the scheduler
(reuse counted exactly, never a shared slot freed, no slot leaked)."""
import random
from array import array

from batchgen.engine.kv_slots import KVSlots
from batchgen.engine.prefix_cache import PrefixCache
from batchgen.engine.request import Sequence
from batchgen.engine.scheduler import Scheduler
from batchgen.sampling_params import SamplingParams
from tests.engine.test_scheduler import drain as drain_scheduler


class Pool:
    def __init__(self):
        self.freed = array("q")

    def free(self, slots):
        self.freed.extend(slots)


def test_match_follows_edges_and_splits_a_partial_one():
    cache = PrefixCache(Pool())
    a = cache.insert(cache.root, [1, 2, 3, 4], array("q", [10, 11, 12, 13]))
    node, slots = cache.match(cache.root, [1, 2, 9])
    assert list(slots) == [10, 11] and list(node.tokens) == [1, 2]  # split after 2 tokens
    assert a.parent is node and list(a.tokens) == [3, 4] and list(a.slots) == [12, 13]
    b = cache.insert(node, [7], array("q", [20]))
    assert list(cache.match(cache.root, [1, 2, 7, 8])[1]) == [10, 11, 20]
    assert list(cache.match(cache.root, [1, 2, 3, 4, 5])[1]) == [10, 11, 12, 13]
    assert list(cache.match(cache.root, [5])[1]) == []
    assert cache.match(cache.root, [1, 2, 7])[0] is b
    assert cache.cached == cache.evictable == 5


def test_locked_paths_survive_eviction_and_lru_goes_first():
    pool = Pool()
    cache = PrefixCache(pool)
    shared = cache.insert(cache.root, [1, 2], array("q", [0, 1]))
    old = cache.insert(shared, [3], array("q", [2]))
    new = cache.insert(shared, [4, 5], array("q", [3, 4]))
    cache.lock(old)
    cache.unlock(old)  # used: older than `new`'s insertion? no: newer
    cache.lock(new)
    assert cache.evictable == 1  # only `old` (shared is on new's path)
    assert cache.evict(100) == 1 and list(pool.freed) == [2]
    assert cache.match(cache.root, [1, 2, 4, 5])[0] is new  # the locked path is whole
    cache.unlock(new)
    assert cache.evictable == cache.cached == 4
    assert cache.evict(1) == 2  # a whole leaf (new), then its parent only when needed
    assert cache.clear() == 2 and sorted(pool.freed) == [0, 1, 2, 3, 4]
    assert cache.cached == cache.evictable == 0 and not cache.root.children


def test_least_recently_used_leaf_is_evicted_first():
    pool = Pool()
    cache = PrefixCache(pool)
    leaves = [cache.insert(cache.root, [t], array("q", [t])) for t in range(4)]
    for t in (2, 0, 3, 1):  # use order: 1 is the most recent
        cache.lock(leaves[t])
        cache.unlock(leaves[t])
    cache.evict(3)
    assert list(pool.freed) == [2, 0, 3]


def make_kv(slots, rows=8, max_len=256):
    return KVSlots(slots, rows)


def seq(i, prompt, max_tokens=4, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return Sequence(i, list(prompt), params, [], {}, 0.0)


def check_ownership(sched):
    """Every slot is exactly one of: free, held by the cache, owned by one running sequence; and a
    running sequence's cached prefix is the cache's path to its node."""
    kv, cache = sched.kv, sched.cache
    owners = list(kv.free_slots)
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        owners += node.slots
        stack += node.children.values()
    for s in sched.running:
        owners += s.slots[s.num_cached :]
        path, node = array("q"), s.cache_node
        while node is not None and node is not cache.root:
            path = node.slots + path
            node = node.parent
        assert path == s.slots[: s.num_cached]
    assert sorted(owners) == list(range(kv.num_slots))


def drain(sched, check=lambda batch: None):
    """test_scheduler's drain, with every slot's owner checked at every step."""

    def checked(batch):
        check(batch)
        check_ownership(sched)

    return drain_scheduler(sched, checked)


def test_rows_sharing_a_prefix_compute_it_once():
    kv = make_kv(4000, rows=16)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=256, prefix_caching=True)
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(100)]
    seqs = [seq(i, system + [1000 + i] + [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]) for i in range(50)]
    for s in seqs:
        sched.add(s)
    computed = []
    done = drain(sched, lambda b: computed.append(b.num_tokens))
    assert len(done) == 50
    assert sorted(s.cached_prompt_tokens for s in seqs) == [0] + [100] * 49
    assert sum(computed) == sum(s.num_prompt + 3 for s in seqs) - 49 * 100  # decodes: max_tokens - 1
    cache = sched.cache
    assert cache.evictable == cache.cached and kv.num_free + cache.cached == kv.num_slots
    cache.clear()
    assert kv.num_free == kv.num_slots and sorted(kv.free_slots) == list(range(kv.num_slots))


def test_whole_prompt_match_still_computes_the_last_token():
    kv = make_kv(100)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True)
    a, b, c = seq("a", range(10)), seq("b", range(10)), seq("c", range(5))  # c: a prefix of a
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a, b, c] and batch.num_new == [10, 1, 1]
    assert (b.cached_prompt_tokens, c.cached_prompt_tokens) == (9, 4)
    # b's and c's rows get a's slots for the positions they reuse
    assert list(batch.prefix_rows) == [b.row] * 9 + [c.row] * 4
    assert list(batch.prefix_positions) == list(range(9)) + list(range(4))
    assert list(batch.prefix_slots) == list(a.slots[:9]) + list(a.slots[:4])
    drain(sched)


def test_small_pool_evicts_and_preempts_without_freeing_shared_slots():
    kv = make_kv(40, rows=6)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=8, prefix_caching=True)
    rng = random.Random(1)
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (0, 1, 5, 12)]
    seqs = []
    for i in range(24):
        p = rng.choice(prefixes)
        rest = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        seqs.append(seq(i, p + rest, max_tokens=rng.randrange(6, 16), ignore_eos=False))  # admits optimistically
    for s in seqs:
        sched.add(s)
    evicted = []
    evict = sched.cache.evict
    sched.cache.evict = lambda n: evicted.append(evict(n)) or evicted[-1]
    done = drain(sched)
    assert sum(evicted) > 0
    assert sorted(s.id for s in done) == list(range(24))
    assert all(s.num_generated == s.params.max_tokens for s in done)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert sched.cache.clear() >= 0 and kv.num_free == kv.num_slots and len(kv.free_rows) == 6
