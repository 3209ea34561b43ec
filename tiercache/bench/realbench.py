"""The trade-off benchmark on a real model: bytes, decode speed, perplexity on code and prose,
agreement with full precision, and long-context retrieval, per setup, in one run.

Interface
- ``SETUPS``: name -> (what it is, how to build it: a ``quantize`` mapping, a YAML file in
  ``configs/`` (skipped when absent), or a transformers baseline name from ``setups.BASELINES``);
  ``DEFAULT``: the names run by default. Group 64, residual 128, keys per channel, values per
  token everywhere, as transformers' QuantizedCache is configured.
- ``run(model, tok, names, prompt, tokens, kinds, greedy_tokens, contexts, depths, log, retrieval_names=None)
  -> (rows, meta)``: (retrieval for ``retrieval_names`` only, when given, and the reference)
  every measurement of every setup. Prompts are prefilled once and fed to each setup's cache
  (``seeded``); rows hold ``bytes`` (after ``prompt + tokens`` tokens of the first text), ``tok_s``
  (teacher-forced decode steps per second, all texts), ``ppl`` / ``ppl_delta`` per text kind
  (relative to the ``DynamicCache`` row), ``top1`` (agreement of teacher-forced argmax with it),
  ``greedy`` (agreement of ``greedy_tokens`` free-running greedy tokens), ``retrieval``
  {context: found / asked} and ``retrieval_acc``.
"""

from __future__ import annotations

import time

import torch

from tiercache.bench import forced, quality, retrieval, seeded, setups, texts

K = {"backend": "native", "group_size": 64, "residual_length": 128, "key_axis": "channel", "value_axis": "token"}
SETUPS = {
    "DynamicCache": ("transformers' full-precision cache (the reference)", "dynamic"),
    "QuantizedCache quanto int4": ("transformers, quanto, g64 r128, axis 0", "quanto-int4"),
    "QuantizedCache quanto int2": ("transformers, quanto, g64 r128, axis 0", "quanto-int2"),
    "int4 min/max": ("int4, min/max (before this work)", {**K, "bits": 4}),
    "int4 +sinks": ("int4, 4 sink tokens exact", {**K, "bits": 4, "sink_tokens": 4}),
    "int4 +sinks +clip": ("int4, 4 sinks, clipping search", {**K, "bits": 4, "sink_tokens": 4, "clip": "mse"}),
    "int2 min/max": ("int2, min/max (before this work)", {**K, "bits": 2}),
    "int2 +clip": ("int2, clipping search alone", {**K, "bits": 2, "clip": "mse"}),
    "int2 +sinks": ("int2, 4 sink tokens exact", {**K, "bits": 2, "sink_tokens": 4}),
    "int2 +sinks +clip": ("int2, 4 sinks, clipping search", {**K, "bits": 2, "sink_tokens": 4, "clip": "mse"}),
    "int2 +sinks +clip +V/channel": ("int2, 4 sinks, clipping search, values per channel",
                                     {**K, "bits": 2, "sink_tokens": 4, "clip": "mse", "value_axis": "channel"}),
    "int2-mixed": ("int2 sinks+clip, the 4 most sensitive layers int4", "smollm2-135m/int2-mixed.yaml"),
}
DEFAULT = tuple(n for n in SETUPS if n != "int2 +sinks +clip +V/channel")  # that one: an ablation on request


def _factory(spec, config):
    if isinstance(spec, str) and spec in setups.BASELINES:
        return setups.baseline_setups([spec], config, "cpu")[0].make
    from tiercache import TieredCache, load_policy

    policy = load_policy(str(setups.REPO_CONFIGS / spec) if isinstance(spec, str) else {"name": "inline", "quantize": spec})
    return lambda: TieredCache.from_policy(policy, config)


def _close(cache) -> None:
    if callable(getattr(cache, "close", None)):
        cache.close()


def run(model, tok, names, prompt: int, tokens: int, kinds, greedy_tokens: int, contexts, depths, log=print,
        retrieval_names=None):
    start = time.perf_counter()
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setup {unknown}; allowed: {', '.join(SETUPS)}")
    names = ["DynamicCache", *[n for n in names if n != "DynamicCache"]]  # the reference first
    missing = [n for n in names if isinstance(SETUPS[n][1], str) and SETUPS[n][1].endswith(".yaml")
               and not (setups.REPO_CONFIGS / SETUPS[n][1]).is_file()]
    for n in missing:
        log(f"skipped {n}: {setups.REPO_CONFIGS / SETUPS[n][1]} not found")
    names = [n for n in names if n not in missing]
    make = {n: _factory(SETUPS[n][1], model.config) for n in names}
    rows = {n: {"name": n, "what": SETUPS[n][0], "ppl": {}, "ppl_delta": {}, "top1": {}, "seconds": 0.0,
                "steps": 0, "retrieval": {}} for n in names}
    for kind in kinds:
        ids = texts.token_ids(tok, kind, prompt + tokens)  # [P + M]
        pre = seeded.prefill(model, ids[:prompt])
        ref = None
        for n in names:
            cache = seeded.seed(make[n](), pre)
            f = forced.teacher_forced(model, cache, pre, ids[prompt:])
            row = rows[n]
            if "bytes" not in row:
                row["bytes"] = sum(setups.cache_nbytes(cache).values())
            _close(cache)
            ref = f if ref is None else ref
            row["ppl"][kind] = quality.perplexity(f.nll)
            row["ppl_delta"][kind] = row["ppl"][kind] / quality.perplexity(ref.nll) - 1
            row["top1"][kind] = quality.agreement(f.top1, ref.top1)
            row["seconds"] += f.seconds
            row["steps"] += f.steps
            log(f"{kind:5s} {n:28s} ppl {row['ppl'][kind]:.3f} ({100 * row['ppl_delta'][kind]:+.2f}%) "
                f"{f.tok_s:.1f} tok/s")
        if greedy_tokens and kind == kinds[0]:
            ref_tokens = None
            for n in names:
                cache = seeded.seed(make[n](), pre)
                out = forced.greedy(model, cache, pre, greedy_tokens)
                _close(cache)
                ref_tokens = out if ref_tokens is None else ref_tokens
                rows[n]["greedy"] = quality.agreement(out, ref_tokens)
    asked = names if retrieval_names is None else [n for n in names if n in retrieval_names or n == "DynamicCache"]
    for sample in retrieval.samples(tok, contexts, depths) if contexts else []:
        pre = seeded.prefill(model, sample.context)
        for n in asked:
            cache = seeded.seed(make[n](), pre)
            ok = retrieval.found(retrieval.answer(model, cache, sample, tok), sample.key)
            _close(cache)
            got, tried = rows[n]["retrieval"].get(sample.length, (0, 0))
            rows[n]["retrieval"][sample.length] = (got + ok, tried + 1)
        log(f"retrieval {sample.length} tokens, depth {sample.depth:.2f}: " + ", ".join(
            f"{n} {rows[n]['retrieval'][sample.length][0]}" for n in asked))
    for row in rows.values():
        row["tok_s"] = row["steps"] / row["seconds"] if row["seconds"] else None
        got = sum(g for g, _ in row["retrieval"].values())
        asked = sum(a for _, a in row["retrieval"].values())
        row["retrieval_acc"] = got / asked if asked else None
    meta = {"prompt": prompt, "tokens": tokens, "texts": list(kinds), "greedy_tokens": greedy_tokens,
            "contexts": list(contexts), "depths": list(depths), "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - start, 1)}
    return list(rows.values()), meta
