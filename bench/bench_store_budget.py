"""The store under a tight budget, as users see it: which next turns find their conversation.

    python bench/bench_store_budget.py [--device-budget 8MiB] [--host-budget 2MiB]

A real ``tiercache serve --model tiny`` on 127.0.0.1 (``tiercache.serve.launch.LiveServer``),
driven by the official ``openai`` client. Three conversations open with ~1,000-token code
prompts (the tiny model holds 4 KiB of K/V per token in 256-token chunks, so ~1,100 tokens take
5 MiB: the default 8 MiB device budget fits about 1.6 of them) and go on in the order
0 0 1 1 2 2 0 0 1 2 2. For each request it prints the prompt tokens and those taken from the
store (``usage.prompt_tokens_details.cached_tokens``), whether the conversation was the one
answered last, and at the end the store's counters from ``/metrics``. Target (issue 32): every
next turn of the conversation answered last takes its whole history from the store.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tiercache.serve.launch import LiveServer

ORDER = [0, 0, 1, 1, 2, 2, 0, 0, 1, 2, 2]


def opening(i: int) -> str:
    return "".join(f"def step_{i}_{k}(state):\n    return state * {k} + {i}\n" for k in range(40))[:1000]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-budget", default="8MiB")
    ap.add_argument("--host-budget", default="2MiB")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="store-budget-"))
    (d / "store.yaml").write_text(json.dumps({"budget": {"device": args.device_budget, "host": args.host_budget,
                                                         "disk": None},
                                              "ladder": [{"name": "host", "offload": {"device": "cpu"}}]}))
    s = LiveServer("--model", "tiny", "--store", str(d / "store.yaml"), log_dir=d).wait_ready()
    try:
        client, last, found, asked = s.client(), None, 0, 0
        talks = {i: [{"role": "user", "content": opening(i)}] for i in range(3)}
        print("| request | conversation | answered last | prompt tokens | from the store |\n|---|---|---|---|---|")
        for n, i in enumerate(ORDER, 1):
            r = client.chat.completions.create(model="tiny", messages=talks[i], temperature=0, max_tokens=24)
            u = r.usage
            cached = u.prompt_tokens_details.cached_tokens
            if last is not None and last[0] == i:
                asked += 1
                found += cached >= last[1] - 1
            print(f"| {n} | {i} | {'yes' if last and last[0] == i else 'no'} | {u.prompt_tokens} | {cached} |")
            talks[i] += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"and step {len(talks[i])}?"}]
            last = (i, u.prompt_tokens + u.completion_tokens)
            while s.http.get("/health").json()["active_requests"]:
                time.sleep(0.05)
        m = s.metrics()
        print(f"\nnext turns of the conversation answered last that found its whole history: {found} of {asked}")
        print(", ".join(f"{k.removeprefix('tiercache_store_')} {v:g}" for k, v in m.items()
                        if k.startswith("tiercache_store_") and k.endswith("_total")))
    finally:
        s.stop()


if __name__ == "__main__":
    main()
