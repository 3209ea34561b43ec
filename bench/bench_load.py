"""A load test of ``tiercache serve`` by an existing load generator (locust), on loopback.

    python bench/bench_load.py [--model tiny] [--users 1,4,8] [--run-time 20] [--max-tokens 32]
                               [--max-active 8] [--threads 1] [--out out/bench_load]

Starts the server (``tiercache serve``, the store on, ``--max-active`` requests generated at
once) in its own process on 127.0.0.1, then for each number of concurrent users runs ``locust
--headless`` for ``--run-time`` seconds with ``bench/locust_openai.py``: closed-loop users, each
streaming a short greedy chat of ``--max-tokens`` tokens through the official ``openai`` client,
the next one as soon as the last ends. Bounded: each locust run has a hard timeout, and in-flight
requests get 30 s to finish when the time is up.

Prints one markdown row per user count: completed requests, failures, requests/s and output
tokens/s (over the run, drain included), TTFT (sending to the first content chunk) p50 / p99,
inter-token latency (every gap between two content chunks of a stream, as the client sees them:
chunks that arrive in one read show a gap near 0) p50 / p99, and the time per output token of a
request (first to last chunk over the gaps between) p50 / p99, in ms. Each user's first request
warms up and is not counted.
Writes ``bench_load.json`` and locust's own CSV statistics under ``--out``.

``--threads-baseline``: the same workload again from plain Python threads (one ``openai`` client
per thread, no locust) for the same time, printing requests/s and tokens/s per user count: on a
loaded box, what the load generator itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from tiercache.serve.launch import ROOT, LiveServer

LOCUSTFILE = Path(__file__).resolve().parent / "locust_openai.py"


def pct(values: list, q: int) -> float:
    """The q-th percentile (linear interpolation between ranks), seconds -> ms."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0] * 1000
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def run_locust(url: str, users: int, args, out: Path) -> dict:
    samples = out / f"samples-{users}.json"
    env = {**os.environ, "LOAD_MODEL": args.model, "LOAD_MAX_TOKENS": str(args.max_tokens),
           "LOAD_SAMPLES": str(samples), "NO_PROXY": "127.0.0.1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
           "-t", f"{args.run_time}s", "--stop-timeout", "30", "-H", url, "--csv", str(out / f"locust-{users}"),
           "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_time + 120)
    if proc.returncode != 0 or not samples.exists():
        raise RuntimeError(f"locust failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads(samples.read_text())
    done, seconds = len(s["chat"]), s["seconds"]
    return {"users": users, "requests": done, "failures": s["failures"], "seconds": seconds,
            "rps": done / seconds, "tokens_per_s": sum(s["tokens"]) / seconds,
            "ttft_p50_ms": pct(s["ttft"], 50), "ttft_p99_ms": pct(s["ttft"], 99),
            "itl_p50_ms": pct(s["itl"], 50), "itl_p99_ms": pct(s["itl"], 99),
            "tpot_p50_ms": pct(s["tpot"], 50), "tpot_p99_ms": pct(s["tpot"], 99),
            "mean_tokens": statistics.fmean(s["tokens"]) if s["tokens"] else 0.0}


def run_threads(server, users: int, args) -> dict:
    """Closed-loop threads, the same requests as the locustfile: requests/s and tokens/s."""
    done, tokens = [0] * users, [0] * users
    stop = time.perf_counter() + args.run_time

    def loop(u: int) -> None:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=httpx.Client(trust_env=False))
        k = 0
        while time.perf_counter() < stop:
            k += 1
            for chunk in client.chat.completions.create(
                    model=args.model, max_tokens=args.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": f"# request t{u}-{k}: write a function that adds two numbers\n"}]):
                if chunk.usage is not None:
                    tokens[u] += chunk.usage.completion_tokens
            done[u] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.run_time + 120)
    seconds = time.perf_counter() - start
    return {"users": users, "rps": sum(done) / seconds, "tokens_per_s": sum(tokens) / seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--users", default="1,4,8", help="comma-separated numbers of concurrent users")
    p.add_argument("--run-time", type=int, default=20, help="seconds of load per user count")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-active", type=int, default=8, help="the server's --max-active")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--out", default="out/bench_load")
    p.add_argument("--threads-baseline", action="store_true", help="also drive the server from plain threads")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    users = [int(u) for u in args.users.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer("--model", args.model, "--max-active", str(args.max_active), "--queue-size", "64",
                            log_dir=Path(tmp), threads=args.threads).wait_ready()
        try:
            server.client().chat.completions.create(model=args.model, messages=[{"role": "user", "content": "warm"}],
                                                    max_tokens=4, temperature=0)  # warm-up, not measured
            rows = []
            for n in users:
                t = time.perf_counter()
                rows.append(run_locust(server.url, n, args, out))
                print(f"  {n} users: {time.perf_counter() - t:.0f} s", file=sys.stderr)
            baseline = [run_threads(server, n, args) for n in users] if args.threads_baseline else []
        finally:
            server.stop()
    print(f"\nload test: locust {args.run_time}s per level, model {args.model}, {args.max_tokens} tokens per answer, "
          f"server --max-active {args.max_active}, {args.threads} torch thread(s), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores\n")
    print("| users | requests | failures | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| TPOT p50 ms | TPOT p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['users']} | {r['requests']} | {r['failures']} | {r['rps']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
              f"{r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} |")
    base = rows[0]
    for r in rows[1:] if base["requests"] > 1 else []:
        print(f"{r['users']} users vs {base['users']}: req/s x{r['rps'] / base['rps']:.2f}, "
              f"TTFT p50 x{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}, TPOT p50 x{r['tpot_p50_ms'] / base['tpot_p50_ms']:.2f}")
    if baseline:
        print("\nthe same requests from plain threads (no locust): " + ", ".join(
            f"{b['users']} users {b['rps']:.2f} req/s {b['tokens_per_s']:.0f} tokens/s" for b in baseline))
    (out / "bench_load.json").write_text(json.dumps({"args": vars(args), "rows": rows, "threads": baseline}, indent=2))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
