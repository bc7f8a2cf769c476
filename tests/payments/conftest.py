"""The Alipay and WeChat Pay fakes, one real process each for the whole session, and
their keys, shared by the contract both adapters keep (test_payments_cn_contract.py),
by each adapter's own tests and by the end-to-end tests; `cn`, one adapter against
its fake, for both providers unless a test names one
(`@pytest.mark.parametrize("cn", ["alipay"], indirect=True)`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.cn_support import CASES, CnStack, KeyPair, cn_stack
from tests.support import ServerProcess


@pytest.fixture(scope="session")
def cn_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, KeyPair]]:
    return {n: c.keys(tmp_path_factory.mktemp(f"{n}-keys")) for n, c in CASES.items()}


@pytest.fixture(scope="session")
def cn_fakes(cn_keys: dict[str, dict[str, KeyPair]]) -> Iterator[dict[str, ServerProcess]]:
    with contextlib.ExitStack() as running:
        yield {n: running.enter_context(c.fake(cn_keys[n])) for n, c in CASES.items()}


@pytest.fixture(params=list(CASES))
async def cn(
    request: pytest.FixtureRequest,
    cn_keys: dict[str, dict[str, KeyPair]],
    cn_fakes: dict[str, ServerProcess],
) -> AsyncIterator[CnStack]:
    name: str = request.param
    async with cn_stack(CASES[name], cn_keys[name], cn_fakes[name]) as stack:
        yield stack
