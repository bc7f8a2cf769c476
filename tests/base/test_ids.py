"""The one id generator: ULIDs that sort by their millisecond, unique, in bulk too."""

from __future__ import annotations

import itertools
import os
import re
import time

import pytest

from gate.base import ids
from gate.base.ids import IDS_PER_CALL_MAX, IDS_PER_REFILL, new_id, new_ids
from gate.inventory.orders import valid_order_id

ULID_RE = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")


def millis(ulid: str) -> int:
    ms = 0
    for c in ulid[:10]:
        ms = ms * 32 + ids.DIGITS.index(c)
    return ms


def test_an_id_is_a_ulid_of_now() -> None:
    before = time.time_ns() // 1_000_000
    made = new_id()
    after = time.time_ns() // 1_000_000
    assert ULID_RE.fullmatch(made) and valid_order_id(made)
    assert before <= millis(made) <= after


def test_ids_are_unique_and_sort_by_their_millisecond() -> None:
    # Several refills of the random parts, over more than one millisecond.
    made = []
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline or len(made) < 4 * IDS_PER_REFILL:
        made.append(new_id())
    assert len(set(made)) == len(made)
    stamps = [m[:10] for m in made]
    assert len(set(stamps)) > 1, "the ids span more than one millisecond"
    # In the order made, the time prefix never goes back, and the ids of a later
    # millisecond sort after every id of an earlier one.
    assert stamps == sorted(stamps)
    by_ms: dict[str, list[str]] = {}
    for m in made:
        by_ms.setdefault(m[:10], []).append(m)
    groups = [by_ms[s] for s in sorted(by_ms)]
    for earlier, later in itertools.pairwise(groups):
        assert max(earlier) < min(later)


def test_the_bulk_form_makes_distinct_ids_of_one_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    made = new_ids(1000)
    after = time.time_ns() // 1_000_000
    assert len(made) == 1000 and len(set(made)) == 1000
    assert all(ULID_RE.fullmatch(m) for m in made)
    assert len({m[:10] for m in made}) == 1
    assert before <= millis(made[0]) <= after
    # The single and the bulk form never meet.
    assert not set(made) & {new_id() for _ in range(1000)}
    assert new_ids(0) == []


def test_the_bulk_form_is_bounded() -> None:
    assert len(new_ids(IDS_PER_CALL_MAX)) == IDS_PER_CALL_MAX
    for n in (-1, IDS_PER_CALL_MAX + 1):
        with pytest.raises(ValueError, match="ids at once"):
            new_ids(n)


def test_a_forked_process_does_not_hand_out_its_parents_ids() -> None:
    new_id()  # the parent has random parts drawn and waiting
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        os.write(write_end, " ".join(new_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        child = set(r.read().decode().split())
    os.waitpid(pid, 0)
    parent = {new_id() for _ in range(8)}
    assert len(child) == 8
    # The random parts: the time prefix may differ between the two anyway.
    assert not {c[10:] for c in child} & {p[10:] for p in parent}
