from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.live import Live, live_daemon


# one daemon a module: the examples, the generated client and the fuzzer each change the
# store their own way
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with live_daemon(tmp_path_factory.mktemp("contract")) as it:
        yield it
