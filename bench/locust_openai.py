"""A locustfile: closed-loop users streaming chat completions through the official ``openai`` client.

Run by ``bench/bench_load.py`` (``locust -f bench/locust_openai.py --headless -u N ...``); settings
come from the environment: ``LOAD_MODEL`` (default ``tiny``), ``LOAD_MAX_TOKENS`` (default 32),
``LOAD_API_KEY``, ``LOAD_SAMPLES`` (a JSON file the raw samples are written to when the run ends).

Each user sends, back to back (no wait), a short chat whose user message is new every time (a
counter in the text: the store's prefix reuse covers the chat template only), greedy, streamed
with ``include_usage``. Reported to locust as three request types, so its own statistics and CSV
show them: ``chat`` (the whole request), ``TTFT`` (sending to the first content chunk) and ``ITL``
(each gap between two content chunks). A request that fails (HTTP error, an error event, no
content) is a ``chat`` failure. The raw samples (seconds) go to ``LOAD_SAMPLES`` for exact
percentiles (locust rounds the times it keeps), with ``tpot``: per request, the time from its
first to its last content chunk over the gaps between them (time per output token). Each user's
first request is not counted (it opens the connection and warms the client up).
"""

from __future__ import annotations

import itertools
import json
import os
import time

import httpx
import openai
from locust import User, constant, events, task

MODEL = os.environ.get("LOAD_MODEL", "tiny")
MAX_TOKENS = int(os.environ.get("LOAD_MAX_TOKENS", "32"))
SAMPLES = {"chat": [], "ttft": [], "itl": [], "tpot": [], "tokens": [], "failures": 0}
_counter = itertools.count()


class ChatUser(User):
    wait_time = constant(0)

    def on_start(self):
        self.client = openai.OpenAI(base_url=self.host.rstrip("/") + "/v1", max_retries=0, timeout=120,
                                    api_key=os.environ.get("LOAD_API_KEY") or "unused",
                                    http_client=httpx.Client(trust_env=False))
        self.warm = False

    def _fire(self, kind: str, seconds: float, exception=None):
        events.request.fire(request_type="openai", name=kind, response_time=seconds * 1000, response_length=0,
                            exception=exception, context={})

    @task
    def chat(self):
        i = next(_counter)
        start = time.perf_counter()
        stamps, tokens = [], 0
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"# request {i}: write a function that adds two numbers\n"}])
            for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
            if not stamps:
                raise RuntimeError("no content in the answer")
        except Exception as e:  # noqa: BLE001 - counted as a failure, the user goes on
            SAMPLES["failures"] += 1
            self._fire("chat", time.perf_counter() - start, e)
            return
        total = time.perf_counter() - start
        if not self.warm:
            self.warm = True
            return
        self._fire("chat", total)
        self._fire("TTFT", stamps[0] - start)
        for a, b in zip(stamps, stamps[1:]):
            self._fire("ITL", b - a)
        SAMPLES["chat"].append(total)
        SAMPLES["ttft"].append(stamps[0] - start)
        SAMPLES["itl"] += [b - a for a, b in zip(stamps, stamps[1:])]
        SAMPLES["tokens"].append(tokens)
        if len(stamps) > 1:
            SAMPLES["tpot"].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))


@events.test_start.add_listener
def _start(environment, **kw):
    SAMPLES["started"] = time.perf_counter()


@events.quitting.add_listener
def _save(environment, **kw):
    SAMPLES["seconds"] = time.perf_counter() - SAMPLES.get("started", time.perf_counter())
    path = os.environ.get("LOAD_SAMPLES")
    if path:
        with open(path, "w") as f:
            json.dump(SAMPLES, f)
