"""A real ``tiercache serve`` process: clients that go away, work that must not stall the event loop,
and shutdown by signal (drain, cancel, persist, exit code), kill -9 in the middle of a save.

Every generation that must outlast the test's window forbids the end-of-sequence token
(``logit_bias``), so it cannot end early by itself and make a check pass by accident."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from tiercache.serve.launch import LiveServer

NO_EOS = {"257": -100}  # the tiny model's end-of-sequence token never sampled


def wait_for(predicate, timeout: float, step: float = 0.01) -> float | None:
    """Seconds until ``predicate()`` holds (None: not within ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(step)
    return None


def active(server) -> int:
    return server.http.get("/health").json()["active_requests"]


def raw_post(server, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket (the test closes it whenever it likes)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


class Stream:
    """A streamed completion read on a thread: its ``data:`` lines as they come."""

    def __init__(self, server, prompt: str, max_tokens: int):
        self.lines: list[str] = []
        self.first = threading.Event()
        self.error = None
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._read, args=(server.url, body), daemon=True)
        self.thread.start()

    def _read(self, url, body):
        try:
            with httpx.Client(base_url=url, timeout=120, trust_env=False) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.first.set()
        except Exception as e:  # noqa: BLE001 - a cut socket: the test says so
            self.error = e

    def events(self) -> list:
        return [json.loads(x) for x in self.lines if x != "[DONE]"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--model", "tiny", log_dir=tmp_path_factory.mktemp("lifecycle"))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


# -- cancellation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3], ids=["one-choice", "three-choices"])
def test_a_non_streaming_client_that_disconnects_frees_its_slot_within_a_second(server, n):
    sock = raw_post(server, "/v1/completions", {"model": "tiny", "prompt": f"def main_{n}():\n", "max_tokens": 3000,
                                                "temperature": 0.8, "seed": 1, "n": n, "logit_bias": NO_EOS})
    try:
        assert wait_for(lambda: active(server) == n, 30) is not None, server.log()
        time.sleep(0.5)  # tokens are flowing: 3000 of them would take far longer than this test
        assert active(server) == n
    finally:
        sock.close()
    freed = wait_for(lambda: active(server) == 0, 10)
    assert freed is not None and freed <= 1.0, f"slot freed after {freed}s"
    start = time.monotonic()
    r = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "x = ", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert time.monotonic() - start < 5


def test_health_answers_while_an_8_mib_body_is_prepared(server):
    """The body's JSON, the chat template and the tokenizer (8M byte-level tokens, then a 400: over
    the context) run in a thread: /health is answered meanwhile, within 100 ms more than the
    slowest of as many polls of the idle server (this machine may be shared: a poll can wait for
    a core with or without the body; on the event loop, the preparation held it for over a second)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a" * (8 * 2**20 - 200)}]})
    result = {}

    def send():
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
            start = time.monotonic()
            result["response"] = c.post("/v1/chat/completions", content=body,
                                        headers={"Content-Type": "application/json"})
            result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as probe:
        idle = []
        for _ in range(30):
            start = time.monotonic()
            probe.get("/health")
            idle.append(time.monotonic() - start)
            time.sleep(0.01)
        sender.start()
        while sender.is_alive():
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
    sender.join()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 10, (latencies, result["seconds"])  # polled all along the preparation
    assert max(latencies) < 0.1 + max(idle), (f"/health took {max(latencies) * 1e3:.0f} ms (idle: at most "
                                              f"{max(idle) * 1e3:.0f} ms; preparation {result['seconds']:.2f}s)")


# -- shutdown -----------------------------------------------------------------------------------------

def test_sigterm_refuses_new_requests_and_lets_the_running_one_finish(tmp_path):
    s = LiveServer("--model", "tiny", "--shutdown-timeout", "60", log_dir=tmp_path).wait_ready()
    try:
        stream = Stream(s, "def finish_me():\n", 400)
        assert stream.first.wait(30), s.log()
        s.signal(signal.SIGTERM)
        assert wait_for(lambda: s.http.get("/health").status_code == 503, 5) is not None  # draining
        health = s.http.get("/health")
        assert health.json()["status"] == "draining" and health.headers["Retry-After"]
        r = s.http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["code"] == "shutting_down"
        assert stream.thread.is_alive(), "the stream ended before the checks: give it more tokens"
        stream.thread.join(60)
        start = time.monotonic()
        assert s.wait(20) == 0
        assert time.monotonic() - start < 10  # it does not wait out --shutdown-timeout
    finally:
        s.stop()
    events = stream.events()
    assert stream.lines[-1] == "[DONE]" and stream.error is None
    assert events[-1]["usage"]["completion_tokens"] == 400  # the whole answer
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "length"


@pytest.mark.slow
def test_sigterm_with_four_streams_cancels_them_in_time_and_the_store_loads_again(tmp_path):
    flags = ("--model", "tiny", "--persist", str(tmp_path / "persisted"), "--shutdown-timeout", "2",
             "--max-active", "4")
    s = LiveServer(*flags, log_dir=tmp_path).wait_ready()
    prompts = [f"# stream {i} of four, long enough to be stored\ndef f{i}(x):\n" for i in range(4)]
    try:
        streams = [Stream(s, p, 3000) for p in prompts]
        assert all(st.first.wait(60) for st in streams), s.log()
        start = time.monotonic()
        s.signal(signal.SIGTERM)
        code = s.wait(2 + 5 + 5)
        took = time.monotonic() - start
    finally:
        log = s.stop()
    assert code == 0 and took <= 2 + 5, (code, took, log)
    for st in streams:
        st.thread.join(10)
        assert st.error is None and st.lines[-1] == "[DONE]"  # not a cut socket
        assert st.events()[-1]["error"]["code"] == "shutting_down"
    assert re.search(r"persist: saved 4 entries", log), log
    again = LiveServer(*flags, log_dir=tmp_path).wait_ready()
    try:
        assert re.search(r"persist: loaded 4 entries", again.log()), again.log()
        r = again.http.post("/v1/completions", json={"model": "tiny", "prompt": prompts[2], "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompts[2]) - 1
    finally:
        again.stop()


def test_a_second_signal_exits_at_once(tmp_path):
    s = LiveServer("--model", "tiny", "--shutdown-timeout", "60", log_dir=tmp_path).wait_ready()
    try:
        stream = Stream(s, "def forever():\n", 3000)
        assert stream.first.wait(30), s.log()
        s.signal(signal.SIGTERM)
        assert wait_for(lambda: s.http.get("/health").status_code == 503, 5) is not None
        start = time.monotonic()
        s.signal(signal.SIGINT)
        assert s.wait(5) == 128 + signal.SIGINT
        assert time.monotonic() - start < 3
    finally:
        s.stop()


def _manifest(directory: Path) -> list[str]:
    return [e["file"] for e in json.loads((directory / "manifest.json").read_text())["entries"]]


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_set_loadable(tmp_path):
    d = tmp_path / "persisted"
    flags = ("--model", "tiny", "--persist", str(d))
    first_prompt = "# the conversation saved by the first shutdown\ndef first():\n"

    def complete(server, prompt):
        r = server.http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()

    s = LiveServer(*flags, log_dir=tmp_path).wait_ready()
    complete(s, first_prompt)
    wait_for(lambda: active(s) == 0, 10)
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0
    s.stop()
    before = _manifest(d)
    assert len(before) == 1

    slow = LiveServer(*flags, log_dir=tmp_path, env={"TIERCACHE_TEST_PERSIST_PAUSE": "5"}).wait_ready()
    try:
        for i in range(2):
            complete(slow, f"# another conversation, number {i}\ndef other_{i}():\n")
        wait_for(lambda: active(slow) == 0, 10)
        slow.signal(signal.SIGTERM)
        new_file = lambda: [p for p in d.glob("entry-*.tiercache") if p.name not in before]  # noqa: E731
        assert wait_for(lambda: bool(new_file()), 30) is not None, slow.log()
        slow.signal(signal.SIGKILL)  # one file of the new set written, the manifest not yet swapped
        assert slow.wait(10) == -signal.SIGKILL
    finally:
        slow.stop()
    assert _manifest(d) == before and all((d / name).is_file() for name in before)

    again = LiveServer(*flags, log_dir=tmp_path).wait_ready()
    try:
        assert re.search(r"persist: loaded 1 entries", again.log()), again.log()
        assert complete(again, first_prompt + "    return 1\n")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        log = again.stop()
    assert re.search(r"persist: saved \d+ entries", log), log
    assert not list(d.glob(".*.tmp")) and sorted(p.name for p in d.glob("*.tiercache")) == sorted(_manifest(d))
