"""Two real servers (uvicorn subprocesses on 127.0.0.1), one real Redis: a conversation whose
next turn lands on the other server reuses its history from Redis, and every Redis fault costs a
prefill, never an answer. The reference for each answer is the writing server's own continuation
(and a ``--no-store`` server: every prompt prefilled in full)."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from redis_proc import start_redis

from tiercache.serve.launch import LiveServer as Server
from tiercache.serve.launch import free_port

pytestmark = pytest.mark.setup_seconds(40)  # orders the file (tests/conftest.py): three servers and a Redis start in its fixture (~20 s); fault tests wait on timeouts

GREEDY = {"temperature": 0, "max_tokens": 40}
STORY = ("Write a function that reads a CSV file of orders (id, customer, amount, date), groups them by "
         "customer, and returns the total amount per customer for each month, sorted by customer name. "
         "Use only the standard library and explain each step in a comment. ")


def store_yaml(d, url, name="store.yaml"):
    path = d / name
    path.write_text(json.dumps({"remote": {"url": url, "chunk_tokens": 32, "timeout": "300ms"}}))
    return str(path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("remote-serve")
    r = start_redis(d)
    flags = ("--model", "tiny", "--store", store_yaml(d, r.url))
    started = {"a": Server(*flags, log_dir=d), "b": Server(*flags, log_dir=d),
               "plain": Server("--model", "tiny", "--no-store", log_dir=d)}
    try:
        for s in started.values():
            s.wait_ready()
        yield {**started, "redis": r, "dir": d}
    finally:
        for s in started.values():
            s.stop()
        r.stop()


def chat(server, messages):
    r = server.client().chat.completions.create(model="tiny", messages=messages, **GREEDY)
    return r.choices[0].message.content, r.usage


def settle(server, seconds: float = 20.0) -> dict:
    """Until the server has handed its last cache back and its chunks are written; its metrics."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = server.metrics()
        if not m["tiercache_active_requests"] and not m["tiercache_remote_pending_writes"]:
            return m
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {seconds}s")


def first_turn(server, topic: str):
    messages = [{"role": "user", "content": f"[{topic}] {STORY}"}]
    answer, usage = chat(server, messages)
    settle(server)
    return messages + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": "Now add type hints."}], usage


def test_the_next_turn_on_the_other_server_reuses_the_history(cluster):
    a, b, plain = cluster["a"], cluster["b"], cluster["plain"]
    messages, usage = first_turn(a, "two servers")
    history = usage.prompt_tokens + usage.completion_tokens
    assert settle(a)["tiercache_remote_chunks_written_total"] >= history // 32
    on_b, usage_b = chat(b, messages)
    assert usage_b.prompt_tokens_details.cached_tokens >= 0.9 * history
    on_a, usage_a = chat(a, messages)  # A's own continuation, from its local store
    assert usage_a.prompt_tokens_details.cached_tokens >= history - 1
    assert on_b == on_a == chat(plain, messages)[0]
    m = settle(b)
    assert m["tiercache_remote_hits_total"] >= 1 and m["tiercache_remote_cached_tokens_total"] >= 0.9 * history
    assert m["tiercache_cached_tokens_total"] >= m["tiercache_remote_cached_tokens_total"]


def test_evicted_and_corrupted_chunks_cost_a_shorter_prefix_never_a_wrong_one(cluster):
    a, b, plain, r = cluster["a"], cluster["b"], cluster["plain"], cluster["redis"]
    r.command("FLUSHALL")
    messages, usage = first_turn(a, "evicted")
    keys = r.command("KEYS", "tiercache:*")  # this conversation's chunks alone
    assert len(keys) >= 8
    r.command("DEL", sorted(keys)[len(keys) // 2])  # as maxmemory would: one chunk gone, somewhere in the chain
    answer, usage_b = chat(b, messages)
    assert usage_b.prompt_tokens_details.cached_tokens <= (len(keys) - 1) * 32  # a shorter prefix
    assert answer == chat(plain, messages)[0]
    messages, _ = first_turn(a, "corrupted")
    corrupt = settle(b)["tiercache_remote_corrupt_chunks_total"]
    for key in r.command("KEYS", "tiercache:*"):
        r.command("SETRANGE", key, 100, b"\xff\x00")  # bytes flipped inside Redis
    answer, usage_b = chat(b, messages)
    assert usage_b.prompt_tokens_details.cached_tokens == 0 and answer == chat(plain, messages)[0]
    assert settle(b)["tiercache_remote_corrupt_chunks_total"] == corrupt + 1  # the first chunk: a miss past it
    assert "refused (checksum mismatch" in b.log()


def test_a_slow_redis_is_a_miss_not_a_stall(cluster):
    a, b, plain, r = cluster["a"], cluster["b"], cluster["plain"], cluster["redis"]
    messages, _ = first_turn(a, "slow")
    before = settle(b)["tiercache_remote_timeouts_total"]
    sleeper = threading.Thread(target=r.command, args=("DEBUG", "SLEEP", "4"), kwargs={"timeout": 10})
    sleeper.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    answer, usage = chat(b, messages)
    took = time.perf_counter() - t0
    sleeper.join()
    assert took < 3, took  # answered by prefill while Redis sleeps for 4 s
    assert usage.prompt_tokens_details.cached_tokens == 0 and answer == chat(plain, messages)[0]
    assert settle(b)["tiercache_remote_timeouts_total"] > before
    time.sleep(1.2)  # the tier asks again after 1 s


def test_redis_killed_mid_conversation_then_back(cluster):
    a, b, plain, r = cluster["a"], cluster["b"], cluster["plain"], cluster["redis"]
    messages, _ = first_turn(a, "killed")
    errors = settle(b)["tiercache_remote_errors_total"]
    r.kill()
    answer, usage = chat(b, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0 and answer == chat(plain, messages)[0]
    m = settle(b)
    assert m["tiercache_remote_errors_total"] > errors and m["tiercache_remote_up"] == 0
    r.start()  # the same port, empty
    time.sleep(1.2)
    messages, usage = first_turn(a, "back again")  # A writes again once Redis answers
    answer, usage_b = chat(b, messages)
    assert usage_b.prompt_tokens_details.cached_tokens >= 0.9 * (usage.prompt_tokens + usage.completion_tokens)
    assert answer == chat(plain, messages)[0]
    assert settle(b)["tiercache_remote_up"] == 1


def test_redis_absent_at_start(cluster, tmp_path):
    plain = cluster["plain"]
    s = Server("--model", "tiny", "--store", store_yaml(tmp_path, f"redis://127.0.0.1:{free_port()}/0"),
               log_dir=tmp_path)
    try:
        s.wait_ready()
        assert re.search(r"remote tier: Redis at redis://127\.0\.0\.1:\d+/0 is not reachable", s.log()), s.log()
        messages, usage = first_turn(s, "absent")
        answer, usage2 = chat(s, messages)
        assert usage2.prompt_tokens_details.cached_tokens >= usage.prompt_tokens  # its local store still works
        assert answer == chat(plain, messages)[0]
        m = settle(s)
        assert m["tiercache_remote_up"] == 0 and m["tiercache_remote_errors_total"] >= 1
    finally:
        s.stop()
