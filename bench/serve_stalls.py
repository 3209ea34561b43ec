"""Store work beside a running stream: ``bench/bench_serve.py --scenario remote-lookup | demotion``.

Each measures the longest gap between two tokens of a running stream while another request makes
the store work, against that work's own time (goal: the gap <= 1/4 of it: the work runs beside
the step, on the store's thread, not inside it):

- ``remote-lookup``: two servers share one ``redis-server`` (started here; ``write: turn``,
  ``--chunk-tokens`` per chunk). Server A answers a ``--history``-token prompt once (its chunks go
  to Redis). Server B, where nothing is stored locally, gets the same history: it looks it up in
  Redis (EXISTS, MGET, decoding, building the cache), leaving one token to prefill. Its own time:
  B's time to first token for such a history on the idle server. Then, on B, a stream decodes
  while another such history (same length, other text) arrives: its longest gap in that window.
- ``demotion``: a server whose device budget holds ``--entries`` stored histories of
  ``--history`` tokens, the stream and little more, with one lower rung (int4 on host memory).
  While the stream decodes, a request whose reservation (``n`` = ``--entries`` choices of
  ``--history`` tokens) needs the room of every stored history arrives: the store demotes them
  all (quantizing each) before it starts. Its own time: the store's ``demotion_seconds`` over
  that window (``tiercache_store_demotion_seconds_total``).

Both run ``--repeats`` times with fresh texts and print every figure and the median ratio.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from tiercache.serve.launch import LiveServer

from serve_load import stream, text_of


def _prompt(tokens: int, offset: int) -> str:
    return text_of(tokens, offset)  # byte-level tiny models: one character per token


def _beside_stream(server, model: str, work) -> dict:
    """Run ``work()`` (-> (start, first token time)) while a stream decodes on ``server``; the longest
    gap of that stream between the work's start and its first token."""
    started, done, running = threading.Event(), threading.Event(), {}
    t = threading.Thread(target=lambda: running.update(stream(server, model, _prompt(200, 300), 3000, started, done)))
    t.start()
    if not started.wait(120):
        raise SystemExit("the running stream did not start")
    time.sleep(0.3)
    begin, first = work()
    quiet = first + 0.3  # then a window as long, with no work: the stream's own longest gap (the machine's noise)
    time.sleep(0.3 + (first - begin) + 0.1)
    done.set()
    t.join()
    times = running["times"]

    def longest(a0, b0):
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= a0 and a <= b0]
        if not gaps:
            raise SystemExit("the running stream ended before the work began (its end of text)")
        return max(gaps)

    return {"longest_gap": longest(begin, first), "tokens_during": sum(1 for x in times if begin <= x <= first),
            "window": first - begin, "quiet_longest_gap": longest(quiet, quiet + first - begin)}


def scenario_remote_lookup(args, tmp: Path) -> dict:
    from tiercache.serve.remote.launch import RedisProcess

    chunk = args.chunk_tokens
    tokens = (args.history - 1) // chunk * chunk + 1  # whole chunks + the one token always prefilled
    redis = RedisProcess(tmp).start()
    (tmp / "remote.yaml").write_text(json.dumps({"budget": {"device": "2GiB"}, "ladder": [],
                                                 "remote": {"url": redis.url, "chunk_tokens": chunk,
                                                            "write": "turn", "timeout": "5s"}}))
    flags = ["--model", args.model, "--store", str(tmp / "remote.yaml")]
    a, b = LiveServer(*flags, log_dir=tmp, threads=None), LiveServer(*flags, log_dir=tmp, threads=None)
    try:
        a.wait_ready(), b.wait_ready()
        stream(b, args.model, _prompt(64, 0), 4)  # warm-up

        def publish(text):
            stream(a, args.model, text, 1)
            end = time.monotonic() + 60
            while a.metrics().get("tiercache_remote_pending_writes", 0) and time.monotonic() < end:
                time.sleep(0.05)
            while a.http.get("/health").json()["active_requests"] and time.monotonic() < end:
                time.sleep(0.05)  # A idle: it takes no CPU from B's lookup
            time.sleep(0.5)

        def lookup(text):
            r = stream(b, args.model, text, 1)
            if not r["cached"] or r["cached"] < tokens - 1:
                raise SystemExit(f"remote-lookup: B reused {r['cached']} tokens, {tokens - 1} expected from Redis")
            return r["start"], r["times"][0]

        runs = []
        for rep in range(args.repeats):
            alone_text, beside_text = (_prompt(tokens, 40000 + 2 * rep * 9973 + k * 9973) for k in (0, 1))
            publish(alone_text), publish(beside_text)
            start, first = lookup(alone_text)
            own = first - start
            time.sleep(0.5)
            row = _beside_stream(b, args.model, lambda: lookup(beside_text))
            row.update(own_time=own, tokens=tokens)
            runs.append(row)
            print(f"  repeat {rep + 1}: a {tokens}-token history from Redis: {own * 1e3:.0f} ms alone (TTFT); "
                  f"longest gap of a running stream meanwhile {row['longest_gap'] * 1e3:.0f} ms "
                  f"({row['longest_gap'] / own:.2f} of it; {row['tokens_during']} tokens streamed in its "
                  f"{row['window'] * 1e3:.0f} ms beside the stream; with no work, the stream's longest gap "
                  f"{row['quiet_longest_gap'] * 1e3:.0f} ms)", flush=True)
    finally:
        a.stop(), b.stop()
        redis.stop()
    return _summary("remote-lookup", args, runs)


def scenario_demotion(args, tmp: Path) -> dict:
    tokens, k = args.history, args.entries
    probe = LiveServer("--model", args.model, log_dir=tmp, threads=None).wait_ready()
    try:  # the bytes of one stored history, of the stream's reservation and of the newcomer's
        stream(probe, args.model, _prompt(tokens, 0), 1)
        time.sleep(0.5)
        entry = probe.metrics()['tiercache_store_bytes{tier="device"}']
    finally:
        probe.stop()
    (tmp / "demote.yaml").write_text(json.dumps({
        "budget": {"device": int(entry * (k + 1.5)), "host": None},  # k histories + the stream, not the newcomer
        "ladder": [{"name": "host-int4", "quantize": {"backend": "native", "bits": 4, "group_size": 64,
                                                      "residual_length": 0}, "offload": {"device": "cpu"}}]}))
    server = LiveServer("--model", args.model, "--store", str(tmp / "demote.yaml"), "--max-active", "12",
                        log_dir=tmp, threads=None).wait_ready()
    try:
        stream(server, args.model, _prompt(64, 0), 4)  # warm-up
        runs = []
        for rep in range(args.repeats):
            for i in range(k):  # k stored histories at rung 0
                stream(server, args.model, _prompt(tokens, 60000 + (rep * k + i) * 7919), 1)
            time.sleep(0.3)
            before = server.metrics()
            box = {}

            def newcomer():
                start = time.perf_counter()
                body = {"model": args.model, "prompt": _prompt(32, 900 + rep), "max_tokens": tokens, "n": k,
                        "temperature": 0.5, "stream": True}
                with server.http.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and '"text"' in line:
                            box["first"] = time.perf_counter()
                            break  # closing the stream cancels it
                return start, box["first"]

            row = _beside_stream(server, args.model, newcomer)
            time.sleep(0.5)
            after = server.metrics()
            key = "tiercache_store_demotion_seconds_total"  # absent from a server before this metric: no ratio
            own = after[key] - before[key] if key in after else None
            moved = after["tiercache_store_demotions_total"] - before["tiercache_store_demotions_total"]
            if not moved:
                raise SystemExit("demotion: nothing was demoted; the budget is not tight enough")
            row.update(own_time=own, demotions=moved, entry_bytes=entry)
            runs.append(row)
            print(f"  repeat {rep + 1}: {moved:.0f} stored {tokens}-token histories demoted to int4 in "
                  f"{own * 1e3 if own else float('nan'):.0f} ms (the store's own time); longest gap of a running stream "
                  f"meanwhile {row['longest_gap'] * 1e3:.0f} ms ({row['longest_gap'] / own if own else float('nan'):.2f} "
                  f"of it; {row['tokens_during']} tokens streamed in the "
                  f"{row['window'] * 1e3:.0f} ms until the newcomer's first token; with no work, the stream's "
                  f"longest gap {row['quiet_longest_gap'] * 1e3:.0f} ms)", flush=True)
    finally:
        server.stop()
    return _summary("demotion", args, runs)


def _summary(name: str, args, runs: list) -> dict:
    ratios = [r["longest_gap"] / r["own_time"] for r in runs if r["own_time"]]
    ratio = statistics.median(ratios) if ratios else float("nan")
    print(f"{name} ({args.model}): median longest gap / the work's own time = {ratio:.2f} (goal <= 0.25)")
    return {"runs": runs, "ratio": ratio}


STALLS = {"remote-lookup": scenario_remote_lookup, "demotion": scenario_demotion}
