"""The server under load, against live ``tiercache serve`` processes on 127.0.0.1 (the ``openai`` client).

    python bench/bench_serve.py --scenario load [--model tiny] [--repeats 2] [--out out/bench_serve]
    python bench/bench_serve.py [--scenario turns] [--model tiny] [--conversations 2] [--turns 32] [--history 4000]
                                [--max-tokens 16] [--store configs/serve/store.yaml] [--out out/bench_serve]

``--scenario load`` runs the three measurements below (or one: ``concurrency``, ``gap``, ``history``),
each repeated ``--repeats`` times with the reference and the candidate interleaved, and prints
every figure, the ratio of each repeat and their median (the CPU may be shared: ``uptime`` is printed):

- ``concurrency``: aggregate decode tokens/s of N streamed completions at once (N = 1, 2, 4, 8;
  ``--context`` prompt tokens each, ``--decode`` new tokens), against one alone. Aggregate = the
  tokens streamed while all N decode (from the last first token to the first last token) / that
  time (one alone: its tokens after the first / their time). Goal (issue 32):
  8 at once >= 3x one alone on ``smollm2-135m``, >= 2x on ``tiny``.
- ``gap``: the longest gap between two tokens of a running stream while a ``--long-prompt``-token
  prompt arrives (sent once the stream decodes), against that prompt's cold prefill (its time to
  first token on the idle server). Goal: <= 1/4.
- ``history``: time to first token of a short next turn after a stored ``--history``-token history
  (a ``--store`` server, the history answered once before) against the same request re-prefilled
  (a ``--no-store`` server). Goal: >= 10x faster.

``--scenario turns`` (the default):

Two servers run side by side (``tiercache serve`` with the store, and with ``--no-store``), each in
its own process on 127.0.0.1, driven by the official ``openai`` client with streaming. Each of N
conversations sends K user turns of held-out text (never trained on), sized so the history
reaches ``--history`` tokens at the last turn; turns are interleaved across conversations, so
the store keeps N conversations at once. Both servers get the very same messages (the store
server's answers go into the history) and answer greedily.

Per turn (mean over conversations): history tokens, cached tokens, time to first token (from
sending the request to the first content chunk) with and without the store and their ratio,
decode tokens/s in both modes (after the first token), the hit rate so far, bytes per tier held
by the store. Prints a markdown table and the figures at the last turn; writes
``bench_serve.json`` and ``bench_serve.png`` (TTFT per turn, both modes) under ``--out``.
Goal: at a 4k-token history, TTFT >= 10x lower with the store, decode speed unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tiercache.bench.corpus import load_split
from tiercache.serve.launch import LiveServer

TIERS = ("device", "host", "disk")


def user_texts(conversations: int, turns: int, chars: int) -> list[list[str]]:
    raw = load_split("heldout", max_bytes=conversations * turns * chars + 1024).tolist()
    text = bytes(b for b in raw if b < 128 and (b >= 32 or b == 10)).decode("ascii")
    return [[text[(c * turns + t) * chars:(c * turns + t + 1) * chars] for t in range(turns)] for c in range(conversations)]


def timed_turn(server, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed greedy answer: text, usage, TTFT and decode tokens/s."""
    start = time.perf_counter()
    stream = server.client().chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    first = last = None
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].delta.content)
    end = last or time.perf_counter()
    n = usage.completion_tokens
    return {"text": "".join(parts), "ttft": (first or end) - start, "prompt": usage.prompt_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens, "tokens": n,
            "decode": (n - 1) / (end - first) if first and n > 1 and end > first else None}


def store_figures(server) -> dict:
    m = server.metrics()
    return {"bytes": {t: int(m.get(f'tiercache_store_bytes{{tier="{t}"}}', 0)) for t in TIERS},
            "hits": m.get("tiercache_store_hits_total", 0), "misses": m.get("tiercache_store_misses_total", 0),
            "demotions": m.get("tiercache_store_demotions_total", 0), "evictions": m.get("tiercache_store_evictions_total", 0)}


def run(args) -> dict:
    chars = max(16, (args.history - args.turns * (args.max_tokens + 24)) // args.turns)
    texts = user_texts(args.conversations, args.turns, chars)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--model", args.model, *(["--policy", args.policy] if args.policy else [])]
        store = LiveServer(*flags, *(["--store", args.store] if args.store else []), log_dir=Path(tmp), threads=None)
        plain = LiveServer(*flags, "--no-store", log_dir=Path(tmp), threads=None)
        try:
            store.wait_ready(), plain.wait_ready()
            for s in (store, plain):  # warm-up
                timed_turn(s, args.model, [{"role": "user", "content": "warm-up"}], 4)
            history = [[] for _ in range(args.conversations)]
            rows = []
            for t in range(args.turns):
                per = []
                for c in range(args.conversations):
                    history[c].append({"role": "user", "content": texts[c][t]})
                    a = timed_turn(store, args.model, history[c], args.max_tokens)
                    b = timed_turn(plain, args.model, history[c], args.max_tokens)
                    per.append((a, b, a["text"] == b["text"]))
                    history[c].append({"role": "assistant", "content": a["text"]})
                rows.append(_row(t + 1, per, store_figures(store)))
                print(_line(rows[-1]), flush=True)
        finally:
            store.stop(), plain.stop()
    return {"model": args.model, "conversations": args.conversations, "turns": args.turns,
            "max_tokens": args.max_tokens, "machine": platform.platform(), "processor": platform.processor(), "rows": rows}


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _row(turn: int, per: list, store: dict) -> dict:
    looked = store["hits"] + store["misses"]
    return {"turn": turn, "history": _mean(a["prompt"] for a, _, _ in per), "cached": _mean(a["cached"] for a, _, _ in per),
            "ttft_store": _mean(a["ttft"] for a, _, _ in per), "ttft_plain": _mean(b["ttft"] for _, b, _ in per),
            "decode_store": _mean(a["decode"] for a, _, _ in per), "decode_plain": _mean(b["decode"] for _, b, _ in per),
            "same_answers": all(same for _, _, same in per), "hit_rate": store["hits"] / looked if looked else 0.0,
            **store}


def _line(r: dict) -> str:
    ratio = r["ttft_plain"] / r["ttft_store"]
    dec = f"{r['decode_store']:.0f} / {r['decode_plain']:.0f}" if r["decode_store"] and r["decode_plain"] else "-"
    mib = " / ".join(f"{r['bytes'][t] / 2**20:.1f}" for t in TIERS)
    return (f"| {r['turn']} | {r['history']:.0f} | {r['cached']:.0f} | {r['ttft_store'] * 1e3:.1f} | "
            f"{r['ttft_plain'] * 1e3:.1f} | {ratio:.1f}x | {dec} | {r['hit_rate']:.0%} | {mib} | {r['same_answers']} |")


HEADER = ("| turn | history tokens | cached tokens | TTFT store (ms) | TTFT no-store (ms) | TTFT ratio | "
          "decode tok/s store / no-store | hit rate | store MiB device / host / disk | same answers |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")


# -- --scenario load --------------------------------------------------------------------------------
def text_of(chars: int, offset: int = 0) -> str:
    """``chars`` characters of held-out ASCII text (one token each for the byte-level tiny models)."""
    raw = load_split("heldout", max_bytes=4 * (offset + chars) + 4096).tolist()
    text = bytes(b for b in raw if 32 <= b < 127).decode("ascii")
    if len(text) < offset + chars:
        raise SystemExit(f"the held-out text has {len(text)} characters, {offset + chars} needed")
    return text[offset:offset + chars]


def stream(server, model: str, prompt: str, max_tokens: int, started: threading.Event | None = None,
           until: threading.Event | None = None) -> dict:
    """One streamed greedy completion: the arrival time of each content chunk, usage. ``started`` is
    set at the first chunk; once ``until`` is set the stream is closed (the server cancels it)."""
    start = time.perf_counter()
    times, parts, usage = [], [], None
    response = server.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    for chunk in response:
        if until is not None and until.is_set():
            response.close()
            break
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            parts.append(chunk.choices[0].text)
            if started is not None:
                started.set()
    return {"start": start, "times": times, "text": "".join(parts), "tokens": usage.completion_tokens if usage else len(times),
            "prompt": usage.prompt_tokens if usage else None,
            "cached": usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None}


class CpuMeter:
    """CPU seconds used by a process (all its threads), sampled every 10 ms: ``used(t0, t1)``.
    Tokens per CPU-second do not depend on how busy the other processes keep the machine."""

    def __init__(self, pid: int):
        self.path, self.samples = Path(f"/proc/{pid}/stat"), []
        self.tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            fields = self.path.read_text().rsplit(")", 1)[1].split()
            self.samples.append((time.perf_counter(), (int(fields[11]) + int(fields[12])) / self.tick))
            time.sleep(0.01)

    def used(self, t0: float, t1: float) -> float:
        def at(t):
            before = [c for s, c in self.samples if s <= t]
            return before[-1] if before else self.samples[0][1]
        return at(t1) - at(t0)

    def stop(self):
        self._stop.set()
        self._thread.join()


def concurrent(server, model: str, n: int, prompts: list, decode: int, meter: CpuMeter | None = None) -> dict:
    """Aggregate decode tokens/s of ``n`` streams at once while all ``n`` decode (from the last first
    token to the first last token), per wall second and per CPU second of the server."""
    out = [None] * n

    def one(i):
        out[i] = stream(server, model, prompts[i], decode)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(r["times"][0] for r in out)
    end = min(r["times"][-1] for r in out)
    if any(r["tokens"] < decode for r in out) or end <= start:  # one ended early (end of text): first to last
        start, end = min(r["times"][0] for r in out), max(r["times"][-1] for r in out)
    tokens = sum(sum(1 for x in r["times"] if start < x <= end) for r in out)
    cpu = meter.used(start, end) if meter is not None else None
    return {"wall": tokens / (end - start), "cpu": tokens / cpu if cpu else None, "tokens": tokens}


def scenario_concurrency(args, tmp: Path) -> dict:
    server = LiveServer("--model", args.model, "--no-store", "--max-active", "8", log_dir=tmp,
                        threads=args.threads).wait_ready()
    meter = CpuMeter(server.proc.pid)
    try:
        prompts = [text_of(args.context * args.chars_per_token, 997 * i) for i in range(8)]
        concurrent(server, args.model, 2, prompts, 8)  # warm-up
        runs = []
        for rep in range(args.repeats):
            row = {n: concurrent(server, args.model, n, prompts, args.decode, meter) for n in (1, 2, 4, 8)}
            runs.append(row)
            print(f"  repeat {rep + 1}: alone {row[1]['wall']:.1f} tok/s ({row[1]['cpu']:.1f} per CPU-s); " + "; ".join(
                f"{n} at once {row[n]['wall']:.1f} tok/s ({row[n]['wall'] / row[1]['wall']:.2f}x; per CPU-s "
                f"{row[n]['cpu'] / row[1]['cpu']:.2f}x)" for n in (2, 4, 8)), flush=True)
    finally:
        meter.stop()
        server.stop()
    ratios = {n: statistics.median(r[n]["wall"] / r[1]["wall"] for r in runs) for n in (2, 4, 8)}
    cpu = {n: statistics.median(r[n]["cpu"] / r[1]["cpu"] for r in runs) for n in (2, 4, 8)}
    goal = 3.0 if "smollm2" in args.model else 2.0
    print(f"concurrency ({args.model}, {args.context}-token prompts, {args.decode} new tokens each, "
          f"{args.threads or 'all'} torch thread(s)): median ratio to one alone, tokens/s: "
          + ", ".join(f"{n}: {ratios[n]:.2f}x" for n in (2, 4, 8)) + "; tokens per server CPU-second: "
          + ", ".join(f"{n}: {cpu[n]:.2f}x" for n in (2, 4, 8)) + f" (goal for 8: >= {goal:g}x)")
    return {"runs": runs, "ratios": ratios, "ratios_per_cpu_second": cpu, "goal_8": goal, "threads": args.threads}


def scenario_gap(args, tmp: Path) -> dict:
    server = LiveServer("--model", args.model, "--no-store", log_dir=tmp, threads=None).wait_ready()
    try:
        stream(server, args.model, text_of(64), 4)  # warm-up
        runs = []
        for rep in range(args.repeats):
            long = text_of(args.long_prompt * args.chars_per_token, 5000 + 7919 * rep)
            cold = stream(server, args.model, long + " ", 1)  # alone: its cold prefill (nothing stored: --no-store)
            prefill = cold["times"][0] - cold["start"]
            started, done, running = threading.Event(), threading.Event(), {}
            t = threading.Thread(target=lambda: running.update(stream(server, args.model, text_of(200, 300), 2000,
                                                                      started, done)))
            t.start()
            started.wait(60)
            time.sleep(0.3)
            arrived = stream(server, args.model, long, 1)
            time.sleep(0.2)
            done.set()
            t.join()
            window = [x for x in running["times"] if arrived["start"] <= x <= arrived["times"][0] + 0.1]
            gaps = [b - a for a, b in zip(running["times"], running["times"][1:]) if b >= arrived["start"]
                    and a <= arrived["times"][0]]
            if not gaps:
                raise SystemExit("gap: the running stream ended before the prompt arrived (its end of text)")
            worst = max(gaps)
            runs.append({"cold_prefill": prefill, "longest_gap": worst, "tokens_during": len(window),
                         "prompt": cold["prompt"], "ttft_beside_stream": arrived["times"][0] - arrived["start"]})
            print(f"  repeat {rep + 1}: {cold['prompt']}-token prompt: cold prefill {prefill * 1e3:.0f} ms; longest gap "
                  f"of the running stream while it arrives {worst * 1e3:.0f} ms ({worst / prefill:.2f} of it; "
                  f"{len(window)} tokens streamed meanwhile; its TTFT beside the stream "
                  f"{runs[-1]['ttft_beside_stream'] * 1e3:.0f} ms)", flush=True)
    finally:
        server.stop()
    ratio = statistics.median(r["longest_gap"] / r["cold_prefill"] for r in runs)
    print(f"gap ({args.model}): median longest gap / cold prefill = {ratio:.2f} (goal <= 0.25)")
    return {"runs": runs, "ratio": ratio}


def scenario_history(args, tmp: Path) -> dict:
    flags = ["--model", args.model]
    store = LiveServer(*flags, *(["--store", args.store] if args.store else []), log_dir=tmp, threads=None)
    plain = LiveServer(*flags, "--no-store", log_dir=tmp, threads=None)
    try:
        store.wait_ready(), plain.wait_ready()
        for s in (store, plain):
            stream(s, args.model, text_of(64), 4)  # warm-up
        runs = []
        for rep in range(args.repeats):
            history = text_of(args.history * args.chars_per_token, 20000 + 9973 * rep)
            first = stream(store, args.model, history, 8)  # the turn that stores the history
            nxt = history + first["text"] + " " + text_of(24 * args.chars_per_token, 100 + rep)
            hit = stream(store, args.model, nxt, 4)
            miss = stream(plain, args.model, nxt, 4)
            t_hit, t_miss = hit["times"][0] - hit["start"], miss["times"][0] - miss["start"]
            runs.append({"prompt": hit["prompt"], "cached": hit["cached"], "ttft_store": t_hit, "ttft_reprefill": t_miss,
                         "first_turn_ttft": first["times"][0] - first["start"]})
            print(f"  repeat {rep + 1}: {hit['prompt']}-token prompt, {hit['cached']} cached: TTFT {t_hit * 1e3:.1f} ms "
                  f"with the stored history vs {t_miss * 1e3:.1f} ms re-prefilled ({t_miss / t_hit:.1f}x)", flush=True)
    finally:
        store.stop(), plain.stop()
    ratio = statistics.median(r["ttft_reprefill"] / r["ttft_store"] for r in runs)
    print(f"history ({args.model}): median TTFT re-prefill / stored = {ratio:.1f}x (goal >= 10x)")
    return {"runs": runs, "ratio": ratio}


SCENARIOS = {"concurrency": scenario_concurrency, "gap": scenario_gap, "history": scenario_history}


def run_load(args) -> dict:
    names = list(SCENARIOS) if args.scenario == "load" else [args.scenario]
    result = {"model": args.model, "machine": platform.platform(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"{name} ({args.model}); uptime: {_uptime()}", flush=True)
            result[name] = SCENARIOS[name](args, Path(tmp))
    result["uptime_after"] = _uptime()
    print(f"uptime after: {result['uptime_after']}")
    return result


def _uptime() -> str:
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["history"] for r in rows], [r["ttft_plain"] * 1e3 for r in rows], "o-", label="--no-store (prefill all)")
    ax.plot([r["history"] for r in rows], [r["ttft_store"] * 1e3 for r in rows], "o-", label="prefix store")
    ax.set_xlabel("history (prompt tokens) at the turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"tiercache serve, {result['model']}: TTFT per turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="turns", choices=["turns", "load", *SCENARIOS])
    p.add_argument("--model", default="tiny")
    p.add_argument("--policy", default=None)
    p.add_argument("--store", default=None, help="store YAML for the store server (default: built-in budget)")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=32)
    p.add_argument("--history", type=int, default=4000, help="history tokens at the last turn (byte-level models: chars)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default="out/bench_serve")
    p.add_argument("--repeats", type=int, default=2, help="load: repeats of each measurement (interleaved)")
    p.add_argument("--context", type=int, default=512, help="concurrency: prompt tokens of each stream")
    p.add_argument("--decode", type=int, default=128, help="concurrency: new tokens of each stream")
    p.add_argument("--threads", type=int, default=1,
                   help="concurrency: the server's torch threads (OMP_NUM_THREADS; 0: all cores)")
    p.add_argument("--long-prompt", type=int, default=3000, help="gap: tokens of the prompt that arrives")
    p.add_argument("--chars-per-token", type=int, default=None,
                   help="characters of text per prompt token (default 1 for the byte-level tiny models, else 4)")
    args = p.parse_args(argv)
    if args.chars_per_token is None:
        args.chars_per_token = 1 if args.model.startswith("tiny") else 4
    if args.scenario != "turns":
        if min(args.repeats, args.context, args.decode, args.long_prompt, args.history) < 1:
            p.error("--repeats, --context, --decode, --long-prompt and --history must be >= 1")
        args.threads = args.threads or None
        result = run_load(args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_serve_{args.scenario}_{args.model.replace('/', '_')}.json"
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {path}")
        return 0
    if min(args.conversations, args.turns, args.history, args.max_tokens) < 1:
        p.error("--conversations, --turns, --history and --max-tokens must be >= 1")
    print(HEADER, flush=True)
    result = run(args)
    last = result["rows"][-1]
    print(f"\nat a {last['history']:.0f}-token history: TTFT {last['ttft_store'] * 1e3:.1f} ms with the store vs "
          f"{last['ttft_plain'] * 1e3:.1f} ms without: {last['ttft_plain'] / last['ttft_store']:.1f}x lower "
          f"(goal >= 10x); decode {last['decode_store'] or 0:.0f} vs {last['decode_plain'] or 0:.0f} tokens/s "
          f"(ratio {(last['decode_store'] or 0) / (last['decode_plain'] or 1):.2f}); hit rate {last['hit_rate']:.0%}; "
          f"answers identical in every turn: {all(r['same_answers'] for r in result['rows'])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "bench_serve.png")
    print(f"wrote {out / 'bench_serve.json'} and {out / 'bench_serve.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
