"""A 500 tells the client an id, never the exception's text; the server's log has the traceback
under that id."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

from starlette.testclient import TestClient

from tiercache.serve.app import create_app
from tiercache.serve.errors import internal_error

SECRET = "token sk-live-123 at /home/alice/weights.bin"


class ExplodingWorker:
    model_name, policy, store, queue_length, active = "tiny", None, None, 0, 0
    codec = SimpleNamespace(vocab_size=256)

    def start(self):
        pass

    def stop(self):
        return True

    def prepare(self, request, emit):
        raise RuntimeError(SECRET)


def _ids(records, eid):
    return [r for r in records if eid in r.getMessage() and r.exc_info and SECRET in str(r.exc_info[1])]


def test_a_500_names_an_id_and_the_log_holds_the_traceback(caplog):
    with caplog.at_level(logging.ERROR, logger="tiercache.serve"), \
            TestClient(create_app(ExplodingWorker()), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500
    error = r.json()["error"]
    m = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\)", error["message"])
    assert m and error["code"] == "internal_error" and error["type"] == "server_error"
    assert SECRET not in r.text and "RuntimeError" not in r.text
    assert len(_ids(caplog.records, m.group(1))) == 1


def test_a_failed_generation_says_what_failed_and_an_id_only(caplog):
    try:
        raise ValueError(SECRET)
    except ValueError as caught:
        e = caught
    with caplog.at_level(logging.ERROR, logger="tiercache.serve"):
        err = internal_error(e, "generation failed")
    m = re.fullmatch(r"generation failed: internal error \(id ([0-9a-f]{12})\)", err.message)
    assert m and err.status == 500 and SECRET not in str(err.body())
    assert len(_ids(caplog.records, m.group(1))) == 1
    assert internal_error(e).message != internal_error(e).message  # a fresh id each time
