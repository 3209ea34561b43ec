"""The server under load, against live ``tiercache serve`` processes on 127.0.0.1 (the ``openai`` client).

    python bench/bench_serve.py --scenario load [--model tiny] [--repeats 2] [--out out/bench_serve]
    python bench/bench_serve.py --scenario remote-lookup | demotion [--history 4000] [--repeats 3]
    python bench/bench_serve.py [--scenario turns] [--model tiny] [--conversations 2] [--turns 32] [--history 4000]
                                [--max-tokens 16] [--store configs/serve/store.yaml] [--out out/bench_serve]

``--scenario load`` (its code: ``bench/serve_load.py``) runs the three measurements below (or one:
``concurrency``, ``gap``, ``history``), each repeated ``--repeats`` times with the reference and the
candidate interleaved, and prints every figure, the ratio of each repeat and their median (the
CPU may be shared: ``uptime`` is printed):

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

``--scenario remote-lookup`` and ``--scenario demotion`` (their code: ``bench/serve_stalls.py``;
tiny models): the longest gap of a running stream while another request looks a ``--history``-token
history up in Redis (``--chunk-tokens`` per chunk), or while the store demotes ``--entries`` stored
histories to make room, against that work's own time. Goal: <= 1/4.

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
import platform
import statistics
import tempfile
import time
from pathlib import Path

from tiercache.models.corpus import load_split
from tiercache.serve.launch import LiveServer

from serve_load import SCENARIOS, run_load  # a sibling module: bench/ is on the path of a script run from it
from serve_stalls import STALLS

TIERS = ("device", "host", "disk")


def user_texts(conversations: int, turns: int, chars: int) -> list[list[str]]:
    raw = load_split("heldout", max_bytes=conversations * turns * chars + 1024).tolist()
    text = bytes(b for b in raw if b < 128 and (b >= 32 or b == 10)).decode("ascii")
    return [[text[(c * turns + t) * chars:(c * turns + t + 1) * chars] for t in range(turns)] for c in range(conversations)]


def timed_turn(server, model: str, messages: list, max_tokens: int, extra_body: dict | None = None) -> dict:
    """One streamed greedy answer: text, usage, TTFT and decode tokens/s (``cached``: None from a
    server that reports no ``prompt_tokens_details``; ``extra_body``: fields beyond OpenAI's, e.g.
    ``cache_salt``)."""
    start = time.perf_counter()
    stream = server.client().chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body)
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
            "cached": getattr(usage.prompt_tokens_details, "cached_tokens", None), "tokens": n,
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


def run_stalls(args) -> dict:
    """One of ``serve_stalls.STALLS`` (store work beside a running stream)."""
    result = {"model": args.model, "machine": platform.platform(), "history": args.history}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{args.scenario} ({args.model}); {_uptime()}", flush=True)
        result[args.scenario] = STALLS[args.scenario](args, Path(tmp))
    result["uptime_after"] = _uptime()
    print(f"after: {result['uptime_after']}")
    return result


def _uptime() -> str:
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="turns", choices=["turns", "load", *SCENARIOS, *STALLS])
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
    p.add_argument("--chunk-tokens", type=int, default=128, help="remote-lookup: tokens per Redis chunk")
    p.add_argument("--entries", type=int, default=4, help="demotion: stored histories demoted at once")
    p.add_argument("--chars-per-token", type=int, default=None,
                   help="characters of text per prompt token (default 1 for the byte-level tiny models, else 4)")
    args = p.parse_args(argv)
    if args.chars_per_token is None:
        args.chars_per_token = 1 if args.model.startswith("tiny") else 4
    if args.scenario in STALLS and not args.model.startswith("tiny"):
        p.error(f"--scenario {args.scenario} sizes its prompts in bytes: it runs the byte-level tiny models")
    if args.scenario in STALLS and (args.history > 4000 or args.chunk_tokens < 16 or args.entries < 1):
        p.error("remote-lookup / demotion: --history at most 4000 (the context is 4096), --chunk-tokens >= 16, "
                "--entries >= 1")
    if args.scenario != "turns":
        if min(args.repeats, args.context, args.decode, args.long_prompt, args.history) < 1:
            p.error("--repeats, --context, --decode, --long-prompt and --history must be >= 1")
        args.threads = args.threads or None
        result = run_load(args) if args.scenario not in STALLS else run_stalls(args)
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
