"""compilelm's version (one place: the package, the compile cache key and the server read it)."""

__version__ = "0.1.0"
