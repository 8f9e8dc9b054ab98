"""--model: a local HF directory, a hub id (where a hub is reachable), or None for the default."""
from __future__ import annotations

from pathlib import Path

from batchgen.models.default_model import ensure_default_model


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"--model {model}: the directory has no config.json")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"--model {model}: no such model directory")
    try:  # "org/name": a hub id
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:
        raise FileNotFoundError(
            f"--model {model}: not a local directory, and the hub download failed ({type(e).__name__}); "
            "pass a local HF directory"
        ) from None
