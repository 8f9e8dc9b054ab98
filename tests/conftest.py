import pytest

from tests.tiny_models import build


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> directory of a tiny random-weight checkpoint (built once per session)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get
