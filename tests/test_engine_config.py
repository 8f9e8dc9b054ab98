"""EngineConfig's GPU switches: on by default, off through the field or its BATCHGEN_* variable."""
from batchgen.config import EngineConfig


def test_gpu_switches_default_on_and_read_their_environment_variables(monkeypatch):
    monkeypatch.delenv("BATCHGEN_PDL", raising=False)
    monkeypatch.delenv("BATCHGEN_SYMM_ALL_REDUCE", raising=False)
    config = EngineConfig()
    assert config.pdl and config.symmetric_all_reduce
    assert not EngineConfig(pdl=False).pdl and not EngineConfig(symmetric_all_reduce=False).symmetric_all_reduce
    monkeypatch.setenv("BATCHGEN_PDL", "0")
    monkeypatch.setenv("BATCHGEN_SYMM_ALL_REDUCE", "0")
    config = EngineConfig()
    assert not config.pdl and not config.symmetric_all_reduce
    assert EngineConfig(pdl=True).pdl  # an explicit value wins
    assert {"pdl": False, "symmetric_all_reduce": False}.items() <= config.to_dict().items()


def test_max_num_seqs_defaults_to_1024_on_a_large_gpu_else_256(monkeypatch):
    """Not given: 1024 on a GPU of 70 GiB or more (an H100/H200: wider decode steps), 256 on a smaller GPU and on
    a CPU, never above the step's token budget; given: as given. An invalid value is a usage error either way."""
    import types

    import pytest
    import torch

    from batchgen.executor import memory

    gpu_bytes = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=gpu_bytes["total"]))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    gpu_bytes["total"] = 80 * 10**9  # an 80 GB H100: 74.5 GiB
    assert memory.resolve_max_num_seqs(None, None, cuda) == 1024
    assert memory.resolve_max_num_seqs(None, 512, cuda) == 512  # (--max-num-batched-tokens 512)
    assert memory.resolve_max_num_seqs(64, None, cuda) == 64
    gpu_bytes["total"] = 48 * 2**30
    assert memory.resolve_max_num_seqs(None, None, cuda) == 256
    assert memory.resolve_max_num_seqs(None, None, cpu) == 256
    assert EngineConfig().max_num_seqs is None
    assert EngineConfig(max_num_batched_tokens=16).max_num_batched_tokens == 16  # (no default seqs to be below)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=16)
