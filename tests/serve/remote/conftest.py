"""A real ``redis-server`` for the remote tier's tests: one per session on a free loopback port
(``--save '' --appendonly no``), stopped at the end; never a fake. Missing ``redis-server`` fails
the tests that need it with how to install it (``make test`` installs it when run as root)."""

from __future__ import annotations

import pytest
from redis_proc import start_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    r = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session's server, emptied for this test."""
    redis_server.command("FLUSHALL")
    return redis_server.url
