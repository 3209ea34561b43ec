"""The load scenarios of ``bench/bench_serve.py --scenario load`` (see its docstring): aggregate decode
speed of N concurrent streams, the longest token gap while a long prompt arrives, time to first token
after a stored history. ``SCENARIOS`` maps each name to ``fn(args, tmp) -> dict``; ``run_load(args)``
runs the chosen ones and returns every figure.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tiercache.models.corpus import load_split
from tiercache.serve.launch import LiveServer

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


def _x(a, b, spec: str = ".2f") -> str:
    """``a / b`` formatted, or ``n/a`` when a CPU reading is missing (a window too short for the
    kernel's clock ticks, as in a smoke run)."""
    return format(a / b, spec) if a and b else "n/a"


def _median(values: list):
    return statistics.median(values) if values else None


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
            print(f"  repeat {rep + 1}: alone {row[1]['wall']:.1f} tok/s ({_x(row[1]['cpu'], 1, '.1f')} per CPU-s); "
                  + "; ".join(f"{n} at once {row[n]['wall']:.1f} tok/s ({row[n]['wall'] / row[1]['wall']:.2f}x; per CPU-s "
                              f"{_x(row[n]['cpu'], row[1]['cpu'])}x)" for n in (2, 4, 8)), flush=True)
    finally:
        meter.stop()
        server.stop()
    ratios = {n: statistics.median(r[n]["wall"] / r[1]["wall"] for r in runs) for n in (2, 4, 8)}
    cpu = {n: _median([r[n]["cpu"] / r[1]["cpu"] for r in runs if r[n]["cpu"] and r[1]["cpu"]]) for n in (2, 4, 8)}
    goal = 3.0 if "smollm2" in args.model else 2.0
    print(f"concurrency ({args.model}, {args.context}-token prompts, {args.decode} new tokens each, "
          f"{args.threads or 'all'} torch thread(s)): median ratio to one alone, tokens/s: "
          + ", ".join(f"{n}: {ratios[n]:.2f}x" for n in (2, 4, 8)) + "; tokens per server CPU-second: "
          + ", ".join(f"{n}: {_x(cpu[n], 1)}x" for n in (2, 4, 8)) + f" (goal for 8: >= {goal:g}x)")
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
