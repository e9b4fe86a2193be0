__version__ = "0.1.0"

# name -> module: the package's headline API, imported on first use so that `import tiny_lm` does not import JAX
_EXPORTS = {
    "Trainer": "run", "RunConfig": "run", "ModelConfig": "model", "TrainConfig": "train_config", "DataConfig": "data",
    "TokenizerConfig": "tokenizer",
    "load_checkpoint": "checkpoint", "generate": "generate", "generate_batch": "generate", "evaluate_text": "score",
    "export_hf": "export", "use_cpu_cores": "parallel",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    "Lazy access to the package's headline classes and functions (`from tiny_lm import Trainer, ModelConfig, ...`)."
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"tiny_lm.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")
