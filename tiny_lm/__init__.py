__version__ = "0.1.0"


def __getattr__(name):
    "Lazy access to the package's headline functions, so `import tiny_lm` does not import JAX."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")
