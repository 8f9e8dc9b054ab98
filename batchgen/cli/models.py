"""`batchgen models`: the embedded default model and its cache."""

from __future__ import annotations


def models() -> None:
    """Show the embedded default model and where its converted copy is cached."""
    from batchgen.models import default_model

    target = default_model.default_model_dir()
    try:
        gguf = str(default_model.gguf_path())
    except FileNotFoundError as e:
        gguf = f"missing: {e}"
    converted = (target / "config.json").exists()
    print(f"default model: {default_model.DEFAULT_MODEL_NAME} (used when --model is not given)")
    print(f"source:        {gguf}")
    print(f"cache:         {target} ({'converted' if converted else 'not converted yet: the first run converts it'})")
    sampling = ", ".join(f"{k} {v}" for k, v in default_model.SAMPLING_DEFAULTS.items())
    print(f"sampling:      {sampling} (its model card's; in the cache's generation_config.json)")
    print("other models:  --model PATH (a local Hugging Face model directory)")
