"""Draft heads: `build.py` makes one for a target, `checkpoint.py` saves and loads it, one module per kind."""
