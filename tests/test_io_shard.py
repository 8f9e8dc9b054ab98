"""--shard I/N (batchgen.io.shard)."""

import pytest

from batchgen.io.shard import Shard


def test_shards_partition_the_rows():
    shards = [Shard.parse(f"{i}/4") for i in range(4)]
    for row in range(100):
        assert sum(row in s for s in shards) == 1
    assert [r for r in range(10) if r in shards[1]] == [1, 5, 9]


def test_no_shard_is_the_whole_input():
    assert Shard.parse(None) == Shard(0, 1) and all(r in Shard.parse("") for r in range(5))


@pytest.mark.parametrize("text", ["4/4", "-1/2", "1/0", "a/b", "1", "1/2/3"])
def test_bad_shards(text):
    with pytest.raises(ValueError, match="shard"):
        Shard.parse(text)
