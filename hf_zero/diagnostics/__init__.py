"""Diagnostics of the machine and the install, for first runs and bug reports (``hf-zero env``)."""
