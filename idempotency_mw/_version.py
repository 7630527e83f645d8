"""The installed version of idempotency-mw, read from the package's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("idempotency-mw")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
