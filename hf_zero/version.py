"""hf_zero's version, in a module of its own: code below the package root (the checkpoint marker,
``hf-zero --version``) reads it without importing the root, which imports them."""

__version__ = "0.1.0"
