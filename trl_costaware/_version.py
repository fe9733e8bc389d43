"""The package's version, in a module of its own so that the scripts and the run record can read it without importing
the package face."""

__version__ = "0.1.0"
