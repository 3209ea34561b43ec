"""Several servers, one Redis: TTFT of a turn that lands on the other server, against re-prefill.

    python bench/bench_remote.py [--models tiny smollm2-135m] [--history 4096] [--chunk-tokens 256]
                                 [--repeats 2] [--max-tokens 8] [--threads N] [--out out/bench_remote]

One real ``redis-server`` on a free loopback port (``tiercache.serve.remote.launch``) and, per
model, live ``tiercache serve`` processes on 127.0.0.1 driven by the ``openai`` client:
- ``plain`` (``--no-store``): the second turn prefills the whole history again (what a server
  without the conversation does today);
- per chunk format (``fp``: the model's dtype; ``int4``: native int4, groups of 64, packed on the
  wire) a pair A / B sharing Redis: turn 1 (a ``--history``-token user message of held-out text)
  on A, whose chunks are written after the turn; turn 2 on B, which finds them in Redis.

Per model and format (median over ``--repeats`` conversations): history tokens, cached tokens on
B, TTFT of turn 2 on B and on ``plain`` and their ratio (target >= 5x at 4k), and the bytes on
the wire per token (B's ``tiercache_remote_bytes_read_total`` over its cached tokens: payload and
headers as read from Redis); int4 over fp (target <= 0.3x). Whether B's answer equals ``plain``'s
is printed too (at fp it should; int4 chunks are lossy). Writes ``bench_remote.json`` under ``--out``.
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
from tiercache.serve.remote.launch import RedisProcess

FORMATS = {"fp": None, "int4": {"bits": 4, "group_size": 64}}


def heldout_text(chars: int, offset: int) -> str:
    raw = load_split("heldout", max_bytes=offset + chars * 2 + 4096).tolist()
    text = bytes(b for b in raw if b < 128 and (b >= 32 or b == 10)).decode("ascii")
    return text[offset:offset + chars]


_CLIENTS: dict = {}


def client(server):
    """An openai client with a long timeout: a 4k prefill of a real model on a busy CPU takes minutes."""
    if server.url not in _CLIENTS:
        import httpx
        import openai

        _CLIENTS[server.url] = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                             timeout=900, http_client=httpx.Client(trust_env=False))
    return _CLIENTS[server.url]


def turn(server, model: str, messages: list, max_tokens: int) -> dict:
    start = time.perf_counter()
    stream = client(server).chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
    first, parts, usage = None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    return {"text": "".join(parts), "ttft": (first or time.perf_counter()) - start, "prompt": usage.prompt_tokens,
            "completion": usage.completion_tokens, "cached": usage.prompt_tokens_details.cached_tokens}


def settle(server, seconds: float = 300.0) -> dict:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = server.metrics()
        if not m.get("tiercache_active_requests") and not m.get("tiercache_remote_pending_writes"):
            return m
        time.sleep(0.05)
    raise RuntimeError("server not idle")


def history_texts(model: str, tokens: int, repeats: int) -> list[str]:
    """Held-out texts of ``tokens`` tokens each (by the model's own tokenizer), one per repeat."""
    from tiercache.models.load import load_model

    _, tok = load_model(model)
    texts = []
    for i in range(repeats):
        text = heldout_text(tokens * 8, 65536 * (i + 1))
        ids = tok.encode(text)[:tokens]
        texts.append(tok.decode(ids))
    return texts


def run_model(args, model: str, redis: RedisProcess, tmp: Path) -> dict:
    plain = LiveServer("--model", model, "--no-store", log_dir=tmp, threads=args.threads).wait_ready(600)
    try:
        texts = history_texts(model, args.history - 160, args.repeats)  # room for the answer and turn 2 (4k context)
        out = {"model": model, "formats": {}}
        for fmt, quantize in FORMATS.items():
            cfg = tmp / f"store-{model}-{fmt}.json"
            cfg.write_text(json.dumps({"remote": {"url": redis.url, "chunk_tokens": args.chunk_tokens,
                                                  "timeout": "5s", "quantize": quantize}}))
            a = LiveServer("--model", model, "--store", str(cfg), log_dir=tmp, threads=args.threads)
            b = LiveServer("--model", model, "--store", str(cfg), log_dir=tmp, threads=args.threads)
            try:
                a.wait_ready(600), b.wait_ready(600)
                for s in (a, b):  # warm-up: the first forward of a process is slower (too short for a chunk)
                    turn(s, model, [{"role": "user", "content": "warm up"}], 2)
                rows = []
                for i in range(args.repeats):
                    redis.command("FLUSHALL")
                    read0 = settle(b).get("tiercache_remote_bytes_read_total", 0)
                    messages = [{"role": "user", "content": f"[{fmt} {i}] " + texts[i]}]
                    first = turn(a, model, messages, args.max_tokens)
                    settle(a)
                    messages += [{"role": "assistant", "content": first["text"]},
                                 {"role": "user", "content": "Summarize the text above in one sentence."}]
                    on_b = turn(b, model, messages, args.max_tokens)
                    read = settle(b)["tiercache_remote_bytes_read_total"] - read0
                    again = turn(plain, model, messages, args.max_tokens)
                    rows.append({"history": first["prompt"] + first["completion"], "cached": on_b["cached"],
                                 "ttft_remote": on_b["ttft"], "ttft_prefill": again["ttft"],
                                 "wire_bytes_per_token": read / max(on_b["cached"], 1),
                                 "same_answer": on_b["text"] == again["text"]})
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "same_answer"}
                med["speedup"] = med["ttft_prefill"] / med["ttft_remote"]
                med["same_answer"] = all(r["same_answer"] for r in rows)
                out["formats"][fmt] = {**med, "runs": rows}
            finally:
                a.stop(), b.stop()
        fp, q = out["formats"]["fp"], out["formats"]["int4"]
        out["int4_over_fp_wire"] = q["wire_bytes_per_token"] / fp["wire_bytes_per_token"]
        return out
    finally:
        plain.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    p.add_argument("--history", type=int, default=4096, help="tokens of history at the second turn")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="OMP threads per server (default: torch's)")
    p.add_argument("--out", default="out/bench_remote")
    args = p.parse_args(argv)
    results = {"platform": platform.platform(), "python": platform.python_version(), "args": vars(args), "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(tmp).start()
        try:
            for model in args.models:
                results["models"].append(run_model(args, model, redis, Path(tmp)))
        finally:
            redis.stop()
    print(f"\nSecond turn on the other server, history ~{args.history} tokens, chunks of {args.chunk_tokens} "
          "(loopback Redis; TTFT medians)\n")
    print("| model | chunks | history | cached | TTFT via Redis | TTFT re-prefill | speedup | wire B/token | same answer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in results["models"]:
        for fmt, f in m["formats"].items():
            print(f"| {m['model']} | {fmt} | {f['history']:.0f} | {f['cached']:.0f} | {f['ttft_remote'] * 1000:.0f} ms | "
                  f"{f['ttft_prefill'] * 1000:.0f} ms | {f['speedup']:.1f}x | {f['wire_bytes_per_token']:.0f} | "
                  f"{'yes' if f['same_answer'] else 'no'} |")
    for m in results["models"]:
        print(f"{m['model']}: int4 chunks carry {m['int4_over_fp_wire']:.3f}x the wire bytes of fp chunks "
              f"(target <= 0.3x); fp speedup {m['formats']['fp']['speedup']:.1f}x (target >= 5x)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_remote.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
