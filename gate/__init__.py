"""Gate: a Redis-fronted admission gate for flash sales of limited stock."""

__version__ = "0.1.0"
