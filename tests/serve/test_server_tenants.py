"""Tenants on a real server (uvicorn subprocess on 127.0.0.1, the official ``openai`` client):
``--api-keys FILE``; a tenant never reuses, nor learns about, another tenant's stored
conversation, nor one stored under another ``cache_salt``; answers are the same either way."""

from __future__ import annotations

import time

import openai
import pytest

from tiercache.cli import main
from tiercache.serve.launch import LiveServer

pytestmark = pytest.mark.setup_seconds(15)  # orders the file (tests/conftest.py): a server started by its fixture

KEYS = {"alice": "sk-alice-7f3a9c", "bob": "sk-bob-51d2e8"}
GREEDY = {"temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.yaml").write_text("alice:\n  key: sk-alice-7f3a9c\n  budget: 64MiB\nbob:\n  keys: [sk-bob-51d2e8]\n")
    s = LiveServer("--model", "tiny", "--api-keys", str(d / "keys.yaml"), log_dir=d)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def client(server, tenant):
    import httpx

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60,
                         http_client=httpx.Client(trust_env=False))


def idle(server, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while server.http.get("/health").json()["active_requests"] and time.monotonic() < end:
        time.sleep(0.05)


def ask(server, tenant, messages, **kw):
    r = client(server, tenant).chat.completions.create(model="tiny", messages=messages, **GREEDY, **kw)
    idle(server)  # the cache is handed back after the answer
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_never_reuses_another_tenants_history(server):
    messages = [{"role": "user", "content": "def alice_private_helper(records):"}]
    first, _ = ask(server, "alice", messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Now add a docstring."}]
    on_bob, bob_cached = ask(server, "bob", messages)  # bob sends alice's exact history
    on_alice, alice_cached = ask(server, "alice", messages)
    assert bob_cached == 0 and alice_cached > 0
    assert on_bob == on_alice  # the answer does not depend on who had it stored
    again, bob_again = ask(server, "bob", messages)  # bob's own copy of it is his to reuse
    assert bob_again > 0 and again == on_bob
    m = server.metrics()
    assert m['tiercache_store_tenant_bytes{tenant="alice"}'] > 0 and m['tiercache_store_tenant_bytes{tenant="bob"}'] > 0


def test_a_cache_salt_splits_a_tenant(server):
    messages = [{"role": "user", "content": "class SaltedQueue:"}]
    first, _ = ask(server, "alice", messages, extra_body={"cache_salt": "project-1"})
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Add a pop method."}]
    _, other_salt = ask(server, "alice", messages, extra_body={"cache_salt": "project-2"})
    _, no_salt = ask(server, "alice", messages)
    _, same_salt = ask(server, "alice", messages, extra_body={"cache_salt": "project-1"})
    _, bob_same_salt = ask(server, "bob", messages, extra_body={"cache_salt": "project-1"})
    assert other_salt == no_salt == bob_same_salt == 0 and same_salt > 0


def test_keys(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-alice-7f3a9", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    r = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = server.http.post("/v1/completions", headers={"Authorization": "Bearer " + KEYS["bob"]},
                         json={"model": "tiny", "prompt": "x", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert server.http.get("/health").status_code == 200  # probes stay open


def test_a_bad_keys_file_stops_the_start(tmp_path, capsys):
    bad = tmp_path / "keys.yaml"
    bad.write_text("alice: {key: sk-one}\nbob: {key: sk-one}\n")
    assert main(["serve", "--model", "tiny", "--api-keys", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "a key of tenant 'bob' is also a key of tenant 'alice'" in err and "sk-one" not in err
    assert main(["serve", "--model", "tiny", "--api-keys", str(tmp_path / "missing.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().err
