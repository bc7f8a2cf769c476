"""The Alipay and WeChat Pay fakes, one real process each for the whole session, and
their keys: shared by the contract both adapters keep
(test_payments_cn_contract.py) and by each adapter's own tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cn_support import ALIPAY, WECHATPAY, CnCase, KeyPair
from tests.support import ServerProcess


def _running(case: CnCase, keys: dict[str, KeyPair]) -> Iterator[ServerProcess]:
    proc = case.fake(keys)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def alipay_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, KeyPair]:
    return ALIPAY.keys(tmp_path_factory.mktemp("alipay-keys"))


@pytest.fixture(scope="session")
def wechatpay_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, KeyPair]:
    return WECHATPAY.keys(tmp_path_factory.mktemp("wechatpay-keys"))


@pytest.fixture(scope="session")
def alipay_fake(alipay_keys: dict[str, KeyPair]) -> Iterator[ServerProcess]:
    yield from _running(ALIPAY, alipay_keys)


@pytest.fixture(scope="session")
def wechatpay_fake(wechatpay_keys: dict[str, KeyPair]) -> Iterator[ServerProcess]:
    yield from _running(WECHATPAY, wechatpay_keys)
