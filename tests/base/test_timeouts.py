"""gate/base/timeouts.py: the deadline's cancellation semantics, on this interpreter and on
the machine's /usr/bin/python3 (Debian 12's 3.11.2, whose asyncio.timeout leaks a
CancelledError when the task was cancelled before and carried on).

The checks use the standard library only, so that the same file runs as a script
under a bare interpreter (`python3 tests/base/test_timeouts.py`, with the worktree on
PYTHONPATH): `test_the_checks_pass_under_the_system_python` does exactly that.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from gate.base.timeouts import deadline_at, deadline_in

SHORT_SECONDS = 0.01
LONG_SECONDS = 30.0
SYSTEM_PYTHON = "/usr/bin/python3"


async def _blocked() -> None:
    await asyncio.Event().wait()


async def _expires() -> str:
    try:
        async with deadline_in(SHORT_SECONDS):
            await _blocked()
    except TimeoutError:
        pass
    else:
        return "the block outlived its deadline"
    task = asyncio.current_task()
    assert task is not None
    if task.cancelling() != 0:
        return f"a cancel request was left behind ({task.cancelling()})"
    # Nothing is left pending: the task goes on awaiting.
    await asyncio.sleep(0)
    await asyncio.sleep(SHORT_SECONDS)
    return "ok"


def check_a_deadline_raises_timeout_error() -> None:
    assert asyncio.run(_expires()) == "ok"


def check_a_passed_deadline_raises_at_the_first_await() -> None:
    async def run() -> str:
        loop = asyncio.get_running_loop()
        try:
            async with deadline_at(loop.time() - 1):
                await asyncio.sleep(0)
        except TimeoutError:
            return "timeout"
        return "none"

    assert asyncio.run(run()) == "timeout"


def check_no_deadline_and_an_early_end_leave_the_task_alone() -> None:
    async def run() -> str:
        async with deadline_in(None):
            await asyncio.sleep(SHORT_SECONDS)
        async with deadline_in(SHORT_SECONDS) as deadline:
            pass
        # Past the deadline's time: its timer was cancelled with the block.
        await asyncio.sleep(SHORT_SECONDS * 3)
        assert not deadline.expired
        return "ok"

    assert asyncio.run(run()) == "ok"


def _cancelled_from_outside(body: Callable[[], Awaitable[None]]) -> str:
    """What a task running `body` ended with once cancelled from outside."""

    async def run() -> str:
        task = asyncio.ensure_future(body())
        await asyncio.sleep(SHORT_SECONDS * 2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "timeout"
        return "finished"

    return asyncio.run(run())


def check_an_outer_cancel_propagates() -> None:
    async def body() -> None:
        async with deadline_in(LONG_SECONDS):
            await _blocked()

    assert _cancelled_from_outside(body) == "cancelled"


def check_an_outer_cancel_at_the_deadline_still_propagates() -> None:
    """The deadline expires and the task is cancelled from outside in the same loop
    iteration: the outer cancel wins, it is not turned into a TimeoutError."""

    async def run() -> str:
        loop = asyncio.get_running_loop()
        when = loop.time() + SHORT_SECONDS

        async def body() -> None:
            async with deadline_at(when):
                await _blocked()

        task = asyncio.ensure_future(body())
        await asyncio.sleep(0)
        # Scheduled for the same moment as the deadline's own timer, after it.
        loop.call_at(when, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "timeout"
        return "finished"

    assert asyncio.run(run()) == "cancelled"


def check_a_task_cancelled_before_gets_timeout_error() -> None:
    """The 3.11.2 bug: a task that caught a cancellation and carried on (its
    cancelling() count 1) enters a deadline that expires. asyncio.timeout there
    leaks CancelledError; the deadline must raise TimeoutError, and the task must be
    able to await afterwards."""

    async def run() -> str:
        task = asyncio.current_task()
        assert task is not None
        inner = asyncio.ensure_future(asyncio.sleep(LONG_SECONDS))
        asyncio.get_running_loop().call_soon(task.cancel)
        try:
            await inner
        except asyncio.CancelledError:
            pass  # caught and carried on, without uncancel(): cancelling() is 1
        assert task.cancelling() == 1, task.cancelling()
        try:
            async with deadline_in(SHORT_SECONDS):
                await _blocked()
        except TimeoutError:
            outcome = "timeout"
        except asyncio.CancelledError:
            return "spurious CancelledError"
        await asyncio.sleep(SHORT_SECONDS)
        return outcome

    assert asyncio.run(run()) == "timeout"


CHECKS = [
    check_a_deadline_raises_timeout_error,
    check_a_passed_deadline_raises_at_the_first_await,
    check_no_deadline_and_an_early_end_leave_the_task_alone,
    check_an_outer_cancel_propagates,
    check_an_outer_cancel_at_the_deadline_still_propagates,
    check_a_task_cancelled_before_gets_timeout_error,
]


def test_the_deadline_semantics() -> None:
    for check in CHECKS:
        check()


def test_the_checks_pass_under_the_system_python() -> None:
    """The same checks under /usr/bin/python3 (3.11.2 on Debian 12), without the
    virtualenv's packages: gate/base/timeouts.py needs none."""
    import pytest

    if not shutil.which(SYSTEM_PYTHON):
        pytest.skip(f"no {SYSTEM_PYTHON} on this machine")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", _SCRIPT, str(Path(__file__).resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"{len(CHECKS)} checks passed"), done.stdout


# -I ignores PYTHONPATH: the worktree is put on sys.path by hand, and the test file is
# run by path (the tests package's __init__ and conftest are not imported).
_SCRIPT = """
import runpy, sys, os
sys.path.insert(0, os.environ["PYTHONPATH"])
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def main() -> int:
    print(f"python {sys.version.split()[0]}")
    for check in CHECKS:
        check()
        print(f"{check.__name__}: ok")
    print(f"{len(CHECKS)} checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
