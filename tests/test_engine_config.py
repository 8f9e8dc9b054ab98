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


def test_max_num_seqs_defaults_by_gpu_size_and_moe(monkeypatch):
    """Not given: 1024 on a GPU of 70 GiB or more (an H100/H200: wider decode steps), 2048 there for a mixture of
    experts, 256 on a smaller GPU and on a CPU, never above the step's token budget; given: as given. An invalid
    value is a usage error either way."""
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
    assert memory.resolve_max_num_seqs(None, None, cuda, moe=True) == 2048
    assert memory.resolve_max_num_seqs(None, 1024, cuda, moe=True) == 1024
    assert memory.resolve_max_num_seqs(None, 512, cuda) == 512  # (--max-num-batched-tokens 512)
    assert memory.resolve_max_num_seqs(64, None, cuda) == 64
    gpu_bytes["total"] = 48 * 2**30
    assert memory.resolve_max_num_seqs(None, None, cuda) == 256
    assert memory.resolve_max_num_seqs(None, None, cuda, moe=True) == 256
    assert memory.resolve_max_num_seqs(None, None, cpu) == 256
    assert EngineConfig().max_num_seqs is None
    assert EngineConfig(max_num_batched_tokens=16).max_num_batched_tokens == 16  # (no default seqs to be below)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=16)


BAD_OPTIONS = [
    ("max_model_len", "8", "'8' is not an integer"),
    ("kv_cache_tokens", 1.5, "1.5 is not an integer"),
    ("max_num_batched_tokens", 0, "must be >= 1, got 0"),
    ("max_num_seqs", True, "True is not an integer"),
    ("max_num_seqs", 0, "must be >= 1, got 0"),
    ("max_num_seqs", 2**31, "must be <= 2147483647, got 2147483648"),  # the CLI's limit (INT32_MAX)
    ("tensor_parallel_size", "2", "'2' is not an integer"),
    ("seed", -1, "must be >= 0, got -1"),  # --seed's range: schema.INT_RANGES["seed"]
    ("seed", 2**63, "must be <= 9223372036854775807, got 9223372036854775808"),
    ("seed", 1.0, "1.0 is not an integer"),
    ("gpu_memory_utilization", "0.5", "'0.5' is not a number"),
    ("cpu_kv_cache_gb", True, "True is not a number"),
    ("cuda_graphs", "false", "'false'; give True or False"),
    ("enable_prefix_caching", 0, "0; give True or False"),
    ("cpu_threads", True, "True; give a number of threads"),
]


def test_every_option_checks_its_type_and_range():
    """Each bad value is one ValueError naming the option as the CLI does (invalid --option-name: ...),
    not a TypeError, nor a torch error after the model loads, nor a value kept or silently replaced."""
    import pytest

    for option, value, what in BAD_OPTIONS:
        with pytest.raises(ValueError) as refused:
            EngineConfig(**{option: value})
        assert str(refused.value).startswith(f"invalid --{option.replace('_', '-')}: {what}"), (option, value)


def test_integer_options_take_their_bounds_and_numpy_integers():
    import numpy as np

    config = EngineConfig(max_num_seqs=2**31 - 1, max_num_batched_tokens=2**31 - 1, max_model_len=1,
                          kv_cache_tokens=np.int64(64), seed=2**63 - 1, tensor_parallel_size=1)
    assert config.kv_cache_tokens == 64 and type(config.kv_cache_tokens) is int
    assert config.seed == 2**63 - 1 and EngineConfig(seed=0).seed == 0
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_llm_refuses_a_bad_option_before_loading_the_model():
    import pytest

    from batchgen import LLM

    with pytest.raises(ValueError, match=r"^invalid --kv-cache-tokens: 1.5 is not an integer$"):
        LLM("no-such-model", kv_cache_tokens=1.5)
