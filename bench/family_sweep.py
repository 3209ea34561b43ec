"""The family sweep: every causal-LM family of the installed transformers, built tiny, with TieredCache.

    python bench/family_sweep.py                      # all of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    python bench/family_sweep.py --families jamba,deepseek_v4 --json sweep.json

For each family: its config class with small sizes (``tests/hybrid_models.tiny_config``: a few
layers, at least one attention layer where the family has any; older field names too), its
causal-LM class (counted on the meta device first: one over ``MAX_PARAMS`` is not built), a 6-token
prompt and 4 greedy new tokens with ``DynamicCache(config=...)`` (the reference), then with
``TieredCache`` under three policies: ``fp`` (full precision), ``offload`` (host tier) and
``int4`` (native, group 4, residual 4). A family is

    served        fp and offload give DynamicCache's very tokens, int4 runs
    wrong         fp or offload give other tokens
    int4 fails    fp and offload are right, int4 raises
    refused       TieredCache raises a PolicyError / CacheError (it says why)
    error         TieredCache raises anything else
    not tiny      its config or model cannot be built tiny here (needs other inputs, a hub file ...)
    no cache run  DynamicCache itself does not run it (the model refuses a Cache, or fails)
    no cache use  DynamicCache runs it but holds nothing after (RWKV, XLNet keep their state elsewhere)

Only ``refused``, ``error``, ``wrong`` and ``int4 fails`` are gaps of tiercache; the target of
issue 31 is none of them. Prints one line per family and a summary; ``--json`` writes the rows.
Each family runs under a time limit (``--timeout``, seconds), single-threaded.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hybrid_models import build  # noqa: E402  (tests/hybrid_models.py: the tiny builders)
from transformers import DynamicCache  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from tiercache import CacheError, PolicyError, TieredCache  # noqa: E402
from tiercache.cache.compat import cache_arg  # noqa: E402

Q = {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 4}
POLICIES = {"fp": {"name": "fp"}, "offload": {"name": "cpu", "offload": {"device": "cpu"}},
            "int4": {"name": "int4", "quantize": Q}}
GAPS = ("refused", "error", "wrong", "int4 fails")
MAX_PARAMS = 50_000_000  # a config whose small sizes did not take (defaults kept) is not tiny


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def generate(model, cache):
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **cache_arg(cache), max_new_tokens=4, min_new_tokens=4, do_sample=False)


def holds(cache) -> bool:
    """Whether any layer of transformers' cache holds a non-empty tensor (K/V, states, indexer keys ...)."""
    def full(v) -> bool:
        if isinstance(v, torch.Tensor):
            return v.numel() > 0
        return isinstance(v, dict) and any(full(x) for x in v.values())

    return any(full(v) for layer in cache.layers for k, v in vars(layer).items() if not k.startswith("_"))


def sweep_one(family: str) -> dict:
    row = {"family": family}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(family, generic=True, max_params=MAX_PARAMS)
    except Exception as e:
        return {**row, "status": "not tiny", "why": f"{type(e).__name__}: {e}"[:200]}
    try:
        ref = DynamicCache(config=model.config)
        want = generate(model, ref)
    except Exception as e:
        return {**row, "status": "no cache run", "why": f"{type(e).__name__}: {e}"[:200]}
    if not holds(ref):
        return {**row, "status": "no cache use", "why": "DynamicCache holds nothing after generate: the model keeps "
                                                        "its state elsewhere (RWKV's state, XLNet's mems ...)"}
    for name, policy in POLICIES.items():
        try:
            got = generate(model, TieredCache.from_policy(policy, model.config))
        except (PolicyError, CacheError) as e:
            return {**row, "status": "int4 fails" if name == "int4" else "refused", "policy": name,
                    "why": f"{type(e).__name__}: {e}"[:300]}
        except Exception as e:
            return {**row, "status": "int4 fails" if name == "int4" else "error", "policy": name,
                    "why": f"{type(e).__name__}: {e}"[:300]}
        if name != "int4" and not torch.equal(got, want):
            return {**row, "status": "wrong", "policy": name, "why": f"{got.tolist()} != {want.tolist()}"}
    return {**row, "status": "served"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=None, help="comma-separated model types (default: every causal-LM family)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per family")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    families = args.families.split(",") if args.families else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    signal.signal(signal.SIGALRM, _alarm)
    rows, start = [], time.perf_counter()
    for family in families:
        t0 = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            row = sweep_one(family)
        except Timeout:
            row = {"family": family, "status": "not tiny", "why": f"over {args.timeout}s"}
        finally:
            signal.alarm(0)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"{family:32s} {row['status']:13s} {row.get('policy', ''):8s} {row.get('why', '')[:150]}", flush=True)
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print(f"\n{len(rows)} families in {time.perf_counter() - start:.0f}s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    gaps = [r["family"] for r in rows if r["status"] in GAPS]
    print(f"tiercache gaps ({len(gaps)}): {', '.join(gaps) or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
