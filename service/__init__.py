"""Switchyard's HTTP service: app factory, settings, routes, errors, auth, metrics, engine registry, CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("switchyard")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
