"""The model cache takes the modes of the process umask, so that a cache shared by a group (its
directory group-owned, setgid) is readable by the group: no 0700 directory, no 0600 file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.models import default_model
from batchgen.models.generation_config import GENERATION_CONFIG
from tests.tiny_gguf import write_default_model_package

REPO = Path(__file__).resolve().parents[1]
UMASK = 0o027  # the group reads, others nothing: neither the 0o022 default nor a fixed mode


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.slow
def test_a_converted_default_model_is_readable_by_the_group(tmp_path):
    """The real conversion code on a tiny stand-in of the wheel's GGUF (tests/tiny_gguf.py): the modes come
    from the umask and the cache, not from the model's size."""
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o2770)  # setgid: what the README advises for a shared cache
    wheel = write_default_model_package(tmp_path / "wheel")
    path = os.pathsep.join(p for p in (str(wheel), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "BATCHGEN_CACHE": str(cache), "PYTHONPATH": path}
    convert = ("import os; os.umask(0o027); from batchgen.models.default_model import ensure_default_model; "
               "print(ensure_default_model())")
    done = subprocess.run([sys.executable, "-c", convert], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    converted = Path(done.stdout.strip())
    found = modes(converted)
    assert {"model.safetensors", "config.json", GENERATION_CONFIG, "tokenizer.json"} <= set(found)
    assert found.pop(".") == 0o2750  # 0o777 & ~umask, and the setgid bit inherited from the shared cache
    assert found == dict.fromkeys(found, 0o640)  # 0o666 & ~umask
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]  # no .converting-* left


def test_sampling_defaults_added_to_an_older_cache_keep_the_umask(tmp_path, monkeypatch):
    """A cache converted by a batchgen that did not write them gets generation_config.json, readable
    by whoever can read the rest of the cache (mkstemp alone makes it 0600)."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    converted = default_model.default_model_dir()
    previous = os.umask(UMASK)
    try:
        converted.mkdir(parents=True)
        (converted / "config.json").write_text("{}")
        default_model.ensure_default_model()
    finally:
        os.umask(previous)
    assert json.loads((converted / GENERATION_CONFIG).read_text()) == default_model.SAMPLING_DEFAULTS
    assert modes(converted) == {".": 0o750, "config.json": 0o640, GENERATION_CONFIG: 0o640}
