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
