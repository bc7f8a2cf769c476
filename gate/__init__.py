"""Gate: a Redis-fronted admission gate for flash sales of limited stock."""

# The one place the version is written: pyproject.toml reads it (dynamic version),
# `gate --version` and the OpenAPI document print it, a release tags it (docs/releasing.md).
__version__ = "0.1.0"
