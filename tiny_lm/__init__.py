__version__ = "0.1.0"


# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")

# %% ../nbs/06_checkpoint.ipynb #2ceb0c6a
def __getattr__(name):
    "Lazy access to the package's headline functions."
    if name == "load_checkpoint":
        from tiny_lm.checkpoint import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'tiny_lm' has no attribute {name!r}")