"""Bucket allocations: "bucket:qty[,bucket:qty…]", as Redis chose and the database took."""

from __future__ import annotations


def parse_alloc(alloc: str) -> list[tuple[int, int]]:
    parts = []
    for part in alloc.split(","):
        if part:
            b, q = part.split(":")
            parts.append((int(b), int(q)))
    return parts


def format_alloc(parts: list[tuple[int, int]]) -> str:
    return ",".join(f"{b}:{q}" for b, q in parts)


def normalise_alloc(alloc: str) -> str:
    """Parts sorted by bucket, so every transaction locks bucket rows in one order."""
    return format_alloc(sorted(parse_alloc(alloc)))
