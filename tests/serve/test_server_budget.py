"""The store keeps what fits, as users see it: a real server on 127.0.0.1, the official ``openai``
client, a device budget that fits about 1.6 conversations of ~1,100 tokens and little room below
(issue 32: before, the next turn of the conversation just answered reused 0 of its ~1,000 tokens)."""

from __future__ import annotations

import json
import time

import pytest

from tiercache.serve.launch import LiveServer

pytestmark = pytest.mark.setup_seconds(15)  # orders the file (tests/conftest.py): a server started by its fixture

MiB = 2**20
TURN = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget")
    # the tiny model: 4 KiB of K/V per token in 256-token chunks, so ~1,100 tokens take 5 MiB
    (d / "store.yaml").write_text(json.dumps({
        "budget": {"device": "8MiB", "host": "2MiB", "disk": None},
        "ladder": [{"name": "host", "offload": {"device": "cpu"}}]}))
    s = LiveServer("--model", "tiny", "--store", str(d / "store.yaml"), log_dir=d)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def idle(s, seconds=20.0):
    end = time.monotonic() + seconds
    while s.http.get("/health").json()["active_requests"] and time.monotonic() < end:
        time.sleep(0.05)


def opening(i: int) -> str:
    lines = [f"def step_{i}_{k}(state):\n    return state * {k} + {i}\n" for k in range(40)]
    return "".join(lines)[:1000]


def test_the_conversation_answered_last_is_found_by_its_next_turn(server):
    client = server.client()
    talks = {c: [{"role": "user", "content": opening(c)}] for c in range(3)}
    order = [0, 0, 1, 1, 2, 2, 0, 0, 1, 2, 2]  # next turns right after, and returns to older ones
    last, seen = None, []
    for c in order:
        r = client.chat.completions.create(model="tiny", messages=talks[c], **TURN)
        u = r.usage
        assert 1000 <= u.prompt_tokens <= 1400
        if last is not None and last[0] == c:  # this conversation was answered last: its whole history is found
            assert u.prompt_tokens_details.cached_tokens >= last[1] - 1, (c, u, seen)
        seen.append((c, u.prompt_tokens, u.prompt_tokens_details.cached_tokens))
        talks[c] += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"and step {len(talks[c])}?"}]
        last = (c, u.prompt_tokens + u.completion_tokens)
        idle(server)
    m = server.metrics()
    assert m['tiercache_store_bytes{tier="device"}'] <= 8 * MiB and m['tiercache_store_bytes{tier="host"}'] <= 2 * MiB
    assert m["tiercache_store_evictions_total"] > 0  # the budget was really tight
