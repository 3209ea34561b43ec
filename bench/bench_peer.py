"""tiercache serve against ``transformers serve --continuous-batching``: the same model, machine and client workload.

    python bench/bench_peer.py [--users 1,8,16] [--context 128] [--decode 64] [--histories 1500,4000]
                               [--turns 6] [--repeats 2] [--threads 1] [--json out/bench_peer.json]
    python bench/bench_peer.py --quick          # a short check (two users, a 300-token history, a small peer cache)

SmolLM2-135M-Instruct (``smollm2-135m``, float32, on the CPU), served by one server at a time on
127.0.0.1 (a free port; each with ``--threads`` torch threads): first ``transformers serve
--continuous-batching`` (on a copy of the converted model's directory whose config names its
architecture, ``bench/peer_server.py``), then ``tiercache serve`` (its default store,
``--max-active`` the largest user count). The same workload for both, through the official
``openai`` client, greedy:

- ``users``: N streamed completions at once (N from ``--users``), each a ``--context``-token
  prompt of held-out text and ``--decode`` new tokens: aggregate decode tokens/s while all N
  decode (``serve_load.concurrent``: from the last first token to the first last token),
  median over ``--repeats``.
- ``history``: one chat conversation per length in ``--histories``: ``--turns`` user turns of
  held-out text, each answered by the server (``--turn-tokens`` new tokens; its own answers go
  into the history, as a client's would), sized so the history reaches that many tokens; then
  the time to first token of the next turn (median over ``--repeats`` next turns with other
  texts after the same history). For tiercache also the same next turn re-prefilled on its own
  server: a fresh ``cache_salt`` per request, so no stored prefix matches. For both servers also
  the same next turn as a new conversation (``cold``): behind a system message naming a fresh
  id, so neither tiercache's store nor ``transformers serve``'s shared cache blocks (on by
  default) hold any of it: the two cold prefills side by side.

Prints every figure and a table of ratios from this one run (tiercache / transformers serve for
tokens/s; transformers serve / tiercache and re-prefill / stored for TTFT), with the targets of
issue 40 beside them; ``--json PATH`` writes them all. The CPU may be shared: the load average
is printed before and after. When ``transformers serve`` cannot start (no CLI, the model cannot
be converted, the process exits or never answers ``/health``), it prints ``SKIP: ...`` with the
reason and exits 0 before tiercache runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tiercache.serve.launch import LiveServer

from bench_serve import timed_turn  # siblings: bench/ is on the path of a script run from it
from peer_server import PeerServer, PeerUnavailable, peer_model_dir, transformers_cli
from serve_load import concurrent, stream, text_of

MODEL = "smollm2-135m"
CHARS_PER_TOKEN = 4  # held-out English prose, SmolLM2's tokenizer: about 4 characters a token
TARGETS = {"users": 1.2, "history_peer": 5.0, "history_reprefill": 10.0}
QUICK = {"users": [1, 2], "context": 32, "decode": 8, "histories": [300], "turns": 2, "turn_tokens": 4, "repeats": 1}
# --quick: transformers serve's paged cache sized for the check (16 blocks of 256 tokens, ~190 MB for SmolLM2)
# instead of 60% of free RAM, whose zero-fill is most of its first request (~40 s of page faults on the CPU)
QUICK_PEER = ("--cb-num-blocks", "16")


def uptime() -> str:
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def run_users(server, model: str, args) -> dict:
    prompts = [text_of(args.context * CHARS_PER_TOKEN, 997 * i) for i in range(max(args.users))]
    out = {}
    for n in args.users:
        runs = [concurrent(server, model, n, prompts, args.decode)["wall"] for _ in range(args.repeats)]
        out[n] = {"runs": runs, "tokens_per_s": statistics.median(runs)}
        print(f"  {n} user(s) at once: {', '.join(f'{r:.1f}' for r in runs)} tok/s (aggregate)", flush=True)
    return out


def run_history(server, model: str, history: int, args, reprefill: bool) -> dict:
    """One conversation grown to ``history`` tokens, then ``--repeats`` next turns timed."""
    base = 50000 + 7 * history
    chars = max(64, (history - args.turns * (args.turn_tokens + 16)) * CHARS_PER_TOKEN // args.turns)
    messages = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": text_of(chars, base + t * chars)})
        answer = timed_turn(server, model, messages, args.turn_tokens)
        messages.append({"role": "assistant", "content": answer["text"]})
    row = {"turns": args.turns, "runs": []}
    for r in range(args.repeats):
        nxt = [*messages, {"role": "user", "content": text_of(48 * CHARS_PER_TOKEN, 1000 + 311 * r)}]
        hit = timed_turn(server, model, nxt, 4)
        cold = timed_turn(server, model, [{"role": "system", "content": f"Session {uuid.uuid4().hex}."}, *nxt], 4)
        run = {"prompt": hit["prompt"], "cached": hit["cached"], "ttft": hit["ttft"], "ttft_cold": cold["ttft"]}
        if reprefill:
            cold = timed_turn(server, model, nxt, 4, extra_body={"cache_salt": f"cold-{uuid.uuid4().hex}"})
            run.update(ttft_reprefill=cold["ttft"], cached_reprefill=cold["cached"])
        row["runs"].append(run)
        print(f"  next turn after a {hit['prompt']}-token conversation ({hit['cached'] or 0} cached): "
              f"TTFT {hit['ttft'] * 1e3:.0f} ms; as a new conversation {run['ttft_cold'] * 1e3:.0f} ms"
              + (f"; re-prefilled (fresh cache_salt) {run['ttft_reprefill'] * 1e3:.0f} ms" if reprefill else ""),
              flush=True)
    row["prompt"] = row["runs"][0]["prompt"]
    row["ttft"] = statistics.median(r["ttft"] for r in row["runs"])
    row["ttft_cold"] = statistics.median(r["ttft_cold"] for r in row["runs"])
    if reprefill:
        row["ttft_reprefill"] = statistics.median(r["ttft_reprefill"] for r in row["runs"])
    return row


def workload(server, model: str, args, reprefill: bool) -> dict:
    start = time.perf_counter()
    stream(server, model, text_of(64 * CHARS_PER_TOKEN), 4)  # warm-up (transformers serve: its first batch)
    print(f"  warm-up request: {time.perf_counter() - start:.1f} s", flush=True)
    return {"users": run_users(server, model, args),
            "history": {h: run_history(server, model, h, args, reprefill) for h in args.histories}}


def ratios(ours: dict, peer: dict) -> list[dict]:
    rows = []
    for n, mine in ours["users"].items():
        theirs = peer["users"][n]["tokens_per_s"]
        rows.append({"workload": f"{n} user(s), aggregate tok/s", "tiercache": mine["tokens_per_s"], "peer": theirs,
                     "ratio": mine["tokens_per_s"] / theirs, "target": TARGETS["users"] if n >= 8 else None})
    for h, mine in ours["history"].items():
        theirs = peer["history"][h]
        rows.append({"workload": f"next turn after {h} tokens of history, TTFT ms", "tiercache": mine["ttft"] * 1e3,
                     "peer": theirs["ttft"] * 1e3, "ratio": theirs["ttft"] / mine["ttft"],
                     "target": TARGETS["history_peer"] if h >= 4000 else None})
        rows.append({"workload": f"  same turn as a new conversation (cold prefill), TTFT ms",
                     "tiercache": mine["ttft_cold"] * 1e3, "peer": theirs["ttft_cold"] * 1e3,
                     "ratio": theirs["ttft_cold"] / mine["ttft_cold"], "target": None})
        rows.append({"workload": f"  same, tiercache re-prefill / stored", "tiercache": mine["ttft"] * 1e3,
                     "peer": None, "reprefill": mine["ttft_reprefill"] * 1e3,
                     "ratio": mine["ttft_reprefill"] / mine["ttft"],
                     "target": TARGETS["history_reprefill"] if h >= 4000 else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | tiercache serve | transformers serve --continuous-batching | ratio (x, higher: tiercache "
             "ahead) | target |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        peer = f"{r['peer']:.1f}" if r["peer"] is not None else f"re-prefill {r['reprefill']:.1f}"
        target = f">= {r['target']:g}x" if r["target"] else ""
        lines.append(f"| {r['workload']} | {r['tiercache']:.1f} | {peer} | {r['ratio']:.2f}x | {target} |")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short check: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
                   + f"; transformers serve {' '.join(QUICK_PEER)}")
    p.add_argument("--users", default="1,8,16", help="comma-separated numbers of concurrent users (each >= 1)")
    p.add_argument("--context", type=int, default=128, help="users: prompt tokens of each stream")
    p.add_argument("--decode", type=int, default=64, help="users: new tokens of each stream")
    p.add_argument("--histories", default="1500,4000", help="comma-separated conversation lengths in tokens")
    p.add_argument("--turns", type=int, default=6, help="history: user turns before the timed one")
    p.add_argument("--turn-tokens", type=int, default=16, help="history: new tokens of each earlier turn")
    p.add_argument("--repeats", type=int, default=2, help="runs of each measurement (the median is compared)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS; 0: all cores)")
    p.add_argument("--transformers", default=None, help="the transformers CLI (default: beside python, else on PATH)")
    p.add_argument("--peer-timeout", type=float, default=300.0, help="seconds transformers serve may take to start")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    else:
        args.users, args.histories = _counts(p, "--users", args.users), _counts(p, "--histories", args.histories)
    for name in ("context", "decode", "turns", "turn_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0 or args.peer_timeout <= 0:
        p.error("--threads must be >= 0 and --peer-timeout > 0")
    if max(args.histories) > 7000:
        p.error(f"--histories: at most 7000 tokens (SmolLM2's context is 8192), got {max(args.histories)}")
    if min(args.histories) < args.turns * (args.turn_tokens + 32):
        p.error(f"--histories: each must be at least --turns x (--turn-tokens + 32) = "
                f"{args.turns * (args.turn_tokens + 32)} tokens")
    args.threads = args.threads or None
    return args


def _counts(p, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{flag} must be comma-separated whole numbers >= 1, got {text!r}")
    return sorted(set(values))


def main(argv=None) -> int:
    args = parse(argv)
    result = {"model": MODEL, "machine": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads or "all",
              "settings": {k: getattr(args, k) for k in ("users", "context", "decode", "histories", "turns",
                                                         "turn_tokens", "repeats")},
              "uptime_before": uptime()}
    print(f"bench_peer ({MODEL}, {args.threads or 'all'} torch thread(s) per server; {result['uptime_before']})",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            exe = transformers_cli(args.transformers)
            from tiercache.models import real

            try:
                source = real.convert(progress=False)
            except real.MissingExtra as e:
                raise PeerUnavailable(f"the model cannot be prepared: {e}") from None
            peer = PeerServer(exe, peer_model_dir(source, tmp), log_dir=tmp, threads=args.threads,
                              extra=QUICK_PEER if args.quick else ())
            try:
                peer.wait_ready(args.peer_timeout)
                print("transformers serve --continuous-batching:", flush=True)
                result["peer"] = workload(peer, peer.model, args, reprefill=False)
            finally:
                peer.stop()
        except PeerUnavailable as e:
            print(f"SKIP: transformers serve cannot start, so there is nothing to compare with: {e}")
            return 0
        ours = LiveServer("--model", MODEL, "--max-active", str(max(args.users)), log_dir=tmp, threads=args.threads,
                          request_timeout=600.0)
        try:
            ours.wait_ready()
            print("tiercache serve:", flush=True)
            result["tiercache"] = workload(ours, MODEL, args, reprefill=True)
        finally:
            ours.stop()
    result["uptime_after"] = uptime()
    result["ratios"] = ratios(result["tiercache"], result["peer"])
    print(f"\n{table(result['ratios'])}\n\n{result['uptime_after']} after the run")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
