"""The package version, read by setup.py and dtp_kernels.__version__ (one source)."""

__version__ = "0.2.0"
