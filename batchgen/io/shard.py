"""`--shard I/N`: which rows of the input this run generates.

Row `index` belongs to shard `index % N` (0-based: shards 0/N … N-1/N). Rows are taken round-robin
rather than by a hash of the id so that shards differ in size by at most one row and a row's shard
is obvious; the index is the row's position in the input (its line number for JSONL), which every
shard reads the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= I < N")

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        """'I/N' -> Shard(I, N); None or '' -> the whole input."""
        if not text:
            return cls()
        parts = text.split("/")
        try:
            index, count = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"shard {text!r} is not of the form I/N, e.g. 0/4") from None
        return cls(index, count)

    def __contains__(self, row_index: int) -> bool:
        return row_index % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
