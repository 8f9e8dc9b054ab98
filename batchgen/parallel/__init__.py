"""The tensor-parallel group an engine's ranks share: its collectives, and the symmetric-memory all-reduce."""
