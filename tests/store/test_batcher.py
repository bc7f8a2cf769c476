"""The per-loop-turn call batcher the script runner, the room's wire and the mirror's
confirmations share: one write per turn, groups bounded, an early write when many wait."""

from __future__ import annotations

import asyncio

from gate.store.batcher import TurnBatcher

Writes = list[list[tuple[str, list[int]]]]


def recorder() -> tuple[Writes, TurnBatcher[str, int]]:
    writes: Writes = []
    return writes, TurnBatcher(lambda groups: writes.append(list(groups)), group_max=3)


async def test_one_turn_is_one_write_grouped_by_key_in_order() -> None:
    writes, batcher = recorder()
    for key, item in [("a", 1), ("b", 2), ("a", 3)]:
        batcher.add(key, item)
    assert writes == [] and batcher.waiting == 3  # nothing before the turn ends
    await asyncio.sleep(0)
    assert writes == [[("a", [1, 3]), ("b", [2])]]
    assert batcher.waiting == 0
    # The next turn is a write of its own.
    batcher.add("b", 4)
    await asyncio.sleep(0)
    assert writes[1:] == [[("b", [4])]]
    await asyncio.sleep(0)
    assert len(writes) == 2  # nothing left, nothing written


async def test_a_full_group_is_set_aside_and_another_opens() -> None:
    writes, batcher = recorder()
    for item in range(7):
        batcher.add("a", item)
    batcher.add("b", 100)
    await asyncio.sleep(0)
    assert writes == [[("a", [0, 1, 2]), ("a", [3, 4, 5]), ("a", [6]), ("b", [100])]]


async def test_flush_every_writes_before_the_turn_ends() -> None:
    writes: Writes = []
    batcher: TurnBatcher[str, int] = TurnBatcher(
        lambda groups: writes.append(list(groups)), group_max=10, flush_every=2
    )
    batcher.add("a", 1)
    assert writes == []
    batcher.add("b", 2)
    assert writes == [[("a", [1]), ("b", [2])]]  # at once, in this turn
    batcher.add("a", 3)
    await asyncio.sleep(0)
    assert writes[1:] == [[("a", [3])]]


async def test_a_turn_schedules_one_callback_at_most() -> None:
    loop = asyncio.get_running_loop()
    scheduled = 0
    call_soon = loop.call_soon

    def counting(*args: object, **kwargs: object) -> asyncio.Handle:
        nonlocal scheduled
        scheduled += 1
        return call_soon(*args, **kwargs)  # type: ignore[arg-type]

    writes, batcher = recorder()
    loop.call_soon = counting  # type: ignore[method-assign]
    try:
        for item in range(100):
            batcher.add(str(item % 5), item)
    finally:
        del loop.call_soon
    assert scheduled == 1
    await asyncio.sleep(0)
    assert sum(len(items) for write in writes for _, items in write) == 100


async def test_an_explicit_flush_writes_what_waits_and_nothing_else() -> None:
    writes, batcher = recorder()
    batcher.flush()
    assert writes == []
    batcher.add("a", 1)
    batcher.flush()
    assert writes == [[("a", [1])]]
    await asyncio.sleep(0)  # the turn's scheduled callback finds nothing left
    assert len(writes) == 1
