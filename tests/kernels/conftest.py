"""Kernel tests run the Triton launchers on CUDA, or on CPU under the Triton interpreter (switched
on by tests/conftest.py before triton is imported)."""
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def device() -> str:
    if HAS_CUDA:
        return "cuda"
    if not INTERPRET:
        pytest.skip("no CUDA GPU, and TRITON_INTERPRET is not 1")
    return "cpu"


# Per dtype (atol, rtol): a few roundings of the output dtype, no looser.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def assert_close():
    def check(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
        """scale widens the dtype's tolerance for ops that round more than once."""
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        atol, rtol = TOLERANCES[actual.dtype]
        torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol * scale)

    return check


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "interpreter_bf16: bf16 cases that hold under the Triton interpreter (pure copies, or no Triton)"
    )


def pytest_collection_modifyitems(config, items):
    # The interpreter keeps bf16 as raw 16-bit integers: arithmetic on it is wrong and fp32 -> bf16
    # truncates. So on CPU bf16 cases run only for copies; on the GPU every dtype runs.
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="bf16 arithmetic is not emulated by the Triton interpreter")
    here = Path(__file__).parent
    for item in items:
        if here not in Path(item.path).parents:  # a conftest hook sees the whole session's items
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("dtype") is torch.bfloat16 and "interpreter_bf16" not in item.keywords:
            item.add_marker(skip)
