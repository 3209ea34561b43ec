"""Bytes copied by buffer regrowth during a chunked prefill, host and device, per 1k tokens.

    python bench/bench_regrow.py                     # 32k tokens in 2k chunks, a 4-layer tiny-width Llama
    python bench/bench_regrow.py --tokens 8192 --chunk 512 --dry-run

A growable buffer that runs out of room allocates a larger one and copies what it holds; this
counts those copies (``Buffer._regrow`` moving held tokens, ``Mirror.relayout`` moving a mirror's
held tokens on the device), by tier kind, with wrappers installed here, so the same script
measures any version of the code. Where ``tiercache.layers.regrowth`` exists its counters are
printed too (they must agree).

Rows: an offloaded cache (``offload: {device: cpu}``: the host tier, plus the device mirrors) and
a resident one (full precision on the device), each fed ``chunk``-token updates of random K/V to
every layer, as a model's chunked prefill calls it, two ways: ``loop`` (the cache told nothing
of the context: a user's own chunk loop) and ``prefill`` (first ``tiercache.cache.prefill.reserve``
with the prompt's length, as ``prefill`` / ``generate`` do, where that exists).
Columns: bytes copied per 1k prefilled tokens (host, device), the cache's own bytes per tier at
the end (``tier_nbytes``), and copied / own. The weights are random: bytes do not depend on them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPE = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
             intermediate_size=128, vocab_size=256)
POLICIES = {"offload": {"name": "offload", "offload": {"device": "cpu"}}, "resident": {"name": "resident"}}


class Counter:
    """Wraps the two regrowth paths and sums the held bytes each one moves, by tier kind."""

    def __init__(self):
        from tiercache.layers.buffer import Buffer
        from tiercache.offload.mirror import Mirror

        self.copied = {"host": 0, "device": 0, "disk": 0}
        regrow, relayout, counter = Buffer._regrow, Mirror.relayout, self

        def counted_regrow(buf, *args, **kwargs):
            before, held = buf.keys, len(buf)
            size = 0 if before is None else held * (buf.spec.key_dim + buf.spec.value_dim) * (
                before.element_size() * buf.spec.batch * buf.spec.heads)
            regrow(buf, *args, **kwargs)
            if buf.keys is not before and held:  # a new allocation took the held tokens
                counter.copied[buf.tier.kind] += size
        def counted_relayout(mirror, cap, key, value, old):
            if old is not None:
                counter.copied["device"] += sum(t.numel() * t.element_size() for t in old)
            return relayout(mirror, cap, key, value, old)

        Buffer._regrow, Mirror.relayout = counted_regrow, counted_relayout


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE, max_position_embeddings=1 << 17)


def run(config, policy: dict, tokens: int, chunk: int, how: str, counter: Counter) -> dict:
    """Feed ``tokens`` random K/V in ``chunk``-token updates to every layer, as a model's chunked
    prefill would (the cache sees the same calls; attention itself does not change the bytes)."""
    from tiercache import TieredCache
    from tiercache.cache import prefill as prefill_module

    try:
        from tiercache.layers import regrowth
    except ImportError:
        regrowth = None
    cache = TieredCache.from_policy(policy, config)
    h, d, layers = SHAPE["num_key_value_heads"], SHAPE["head_dim"], SHAPE["num_hidden_layers"]
    g = torch.Generator().manual_seed(1)
    start = dict(counter.copied)
    own_start = regrowth.copied() if regrowth else None
    reserve = getattr(prefill_module, "reserve", None)
    if how == "prefill" and reserve is not None:
        reserve(cache, tokens)  # what tiercache.cache.prefill.prefill does first
    with torch.no_grad():
        for s in range(0, tokens, chunk):
            t = min(chunk, tokens - s)
            for i in range(layers):
                cache.update(torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g), i)
    copied = {k: counter.copied[k] - start[k] for k in counter.copied}
    own = cache.tier_nbytes()
    row = {"copied": copied, "own": own, "reserved": how == "prefill" and reserve is not None,
           "counted": None if regrowth is None else {k: v - own_start.get(k, 0) for k, v in regrowth.copied().items()}}
    cache.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens prefilled (default 32768)")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per prefill forward (default 2048)")
    ap.add_argument("--dry-run", action="store_true", help="a short run (4096 tokens in 512-token chunks)")
    args = ap.parse_args(argv)
    tokens, chunk = (4096, 512) if args.dry_run else (args.tokens, args.chunk)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    config, counter = model_config(), Counter()
    import tiercache

    print(f"tiercache at {Path(tiercache.__file__).parent}; {tokens} tokens in {chunk}-token chunks, "
          f"{SHAPE['num_hidden_layers']} layers, {SHAPE['num_key_value_heads']} KV heads of {SHAPE['head_dim']}, fp32")
    head = f"{'cache':<9} {'fed by':<8} {'host MiB/1k':>11} {'dev MiB/1k':>10} {'host own MiB':>12} " \
           f"{'dev own MiB':>11} {'host copied/own':>15} {'dev copied/own':>14}  regrowth counters (MiB)"
    print(head)
    mib = 1 << 20
    for name, policy in POLICIES.items():
        for how in ("loop", "prefill"):
            r = run(config, policy, tokens, chunk, how, counter)
            c, own = r["copied"], r["own"]
            per_k = {k: v / mib / (tokens / 1024) for k, v in c.items()}
            ratio = {k: (c[k] / own[k] if own.get(k) else 0.0) for k in ("host", "device")}
            counted = "n/a" if r["counted"] is None else " ".join(
                f"{k} {v / mib:.2f}" for k, v in r["counted"].items() if k != "disk")
            print(f"{name:<9} {how:<8} {per_k['host']:>11.3f} {per_k['device']:>10.3f} "
                  f"{own.get('host', 0) / mib:>12.2f} {own.get('device', 0) / mib:>11.2f} "
                  f"{ratio['host']:>15.2f} {ratio['device']:>14.2f}  {counted}"
                  + ("" if how == "loop" or r["reserved"] else "  (this version does not reserve)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
