"""``start_redis(directory, **kw)``: a real redis-server for a test, or the test fails saying how to install it."""

from __future__ import annotations

import pytest

from tiercache.serve.remote.launch import RedisMissing, RedisProcess


def start_redis(directory, **kw) -> RedisProcess:
    try:
        return RedisProcess(directory, **kw).start()
    except RedisMissing as e:
        pytest.fail(str(e), pytrace=False)
