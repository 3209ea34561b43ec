"""The trade-off benchmark on a real model: bytes, decode speed, perplexity on code and prose,
agreement with full precision, and long-context retrieval, per setup, in one run.

Interface
- ``SETUPS``: name -> (what it is, how to build it: a ``quantize`` mapping, a YAML file in
  ``configs/`` (skipped when absent), or a transformers baseline name from ``setups.BASELINES``);
  ``DEFAULT``: the names run by default. Group 64, residual 128, keys per channel, values per
  token everywhere, as transformers' QuantizedCache is configured. A setup name may also be a
  policy file of the user's (``setup_names``).
- ``setup_names(asked) -> list[str]``: the setups asked, the reference first; ``ValueError`` for an
  unknown name or a policy file that is not there (``setups.check_names``), before any model
  is loaded.
- ``run(model, tok, names, prompt, tokens, kinds, greedy_tokens, contexts, depths, log, retrieval_names=None)
  -> (rows, meta)``: (retrieval for ``retrieval_names`` only, when given, and the reference)
  every measurement of every setup. ``texts_per_kind`` held-out texts of each kind
  (``multitext.windows``) are prefilled once and fed to each setup's cache (``seeded``), then
  decoded as one batch; rows hold ``bytes`` (per text, after ``prompt + tokens`` tokens), ``tok_s``
  (teacher-forced batched decode steps per second), ``ppl`` (over all texts of a kind) and
  ``ppl_delta`` (the mean over texts of each text's perplexity increase over the ``DynamicCache``
  row) per text kind, ``ppl_spread`` (``multitext.spread``: per-text deltas, 90% bootstrap interval), ``top1`` (agreement of teacher-forced argmax with it),
  ``greedy`` (agreement of ``greedy_tokens`` free-running greedy tokens), ``retrieval``
  {context: found / asked} and ``retrieval_acc``.
"""

from __future__ import annotations

import time

import torch

from research import forced, multitext, retrieval, seeded
from tiercache.bench import quality, setups

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
}
DEFAULT = tuple(SETUPS)
# ablations, run on request (--setups): one technique changed at a time
S4, S2 = {**K, "bits": 4, "sink_tokens": 4}, {**K, "bits": 2, "sink_tokens": 4}
SETUPS.update({
    "int4 +sinks +clipV": ("int4, 4 sinks, clipping search on values only", {**S4, "clip": "mse-values"}),
    "int4 +sinks +clipK": ("int4, 4 sinks, clipping search on keys only", {**S4, "clip": "mse-keys"}),
    "int4 K/token +sinks": ("int4, 4 sinks, keys per token", {**S4, "key_axis": "token"}),
    "int4 K/token +sinks +clipV": ("int4, 4 sinks, keys per token, clipping on values",
                                   {**S4, "key_axis": "token", "clip": "mse-values"}),
    "int4 +16 sinks +clipV": ("int4, 16 sinks, clipping on values", {**S4, "sink_tokens": 16, "clip": "mse-values"}),
    "int2 +sinks +clipV": ("int2, 4 sinks, clipping search on values only", {**S2, "clip": "mse-values"}),
    "int2 +sinks +clipK": ("int2, 4 sinks, clipping search on keys only", {**S2, "clip": "mse-keys"}),
    "int2 +8 sinks": ("int2, 8 sinks", {**S2, "sink_tokens": 8}),
    "int2 +16 sinks": ("int2, 16 sinks", {**S2, "sink_tokens": 16}),
    "int2 +16 sinks +clipV": ("int2, 16 sinks, clipping on values", {**S2, "sink_tokens": 16, "clip": "mse-values"}),
    "int2 +sinks +clip +V/channel": ("int2, 4 sinks, clipping search, values per channel",
                                     {**S2, "clip": "mse", "value_axis": "channel"}),
    "int2 +sinks +clipV +V/channel": ("int2, 4 sinks, clipping on values, values per channel",
                                      {**S2, "clip": "mse-values", "value_axis": "channel"}),
    "int2 +sinks K4 everywhere": ("int2 values, int4 keys on every layer, 4 sinks", {**S2, "key_bits": 4}),
    "int2 +sinks V4 everywhere": ("int4 values, int2 keys on every layer, 4 sinks", {**S2, "value_bits": 4}),
    "int4 +sinks +clip +K8 on 4 layers": ("int4, 4 sinks, clipping, int8 keys on layers 17, 18, 20, 23",
                                          {"name": "int4-k8", "quantize": {**S4, "clip": "mse"},
                                           "overrides": [{"layers": [17, 18, 20, 23], "quantize": {"key_bits": 8}}]}),
    "int4 +sinks meta8": ("int4, 4 sinks, scales and offsets as bytes (meta_bits 8)", {**S4, "meta_bits": 8}),
    "int2 +sinks meta8": ("int2, 4 sinks, scales and offsets as bytes (meta_bits 8)", {**S2, "meta_bits": 8}),
})


def _close(cache) -> None:
    if callable(getattr(cache, "close", None)):
        cache.close()


def setup_names(asked) -> list[str]:
    asked = setups.check_names(asked, SETUPS)
    return ["DynamicCache", *[n for n in asked if n != "DynamicCache"]]  # the reference first


def run(model, tok, names, prompt: int, tokens: int, kinds, greedy_tokens: int, contexts, depths, log=print,
        retrieval_names=None, texts_per_kind: int = 1):
    start = time.perf_counter()
    names = setup_names(names)
    missing = [n for n in names if n in SETUPS and isinstance(SETUPS[n][1], str) and SETUPS[n][1].endswith(".yaml")
               and not (setups.REPO_CONFIGS / SETUPS[n][1]).is_file()]
    for n in missing:
        log(f"skipped {n}: {setups.REPO_CONFIGS / SETUPS[n][1]} not found")
    names = [n for n in names if n not in missing]
    table = {n: SETUPS[n] if n in SETUPS else (f"the policy file {n}", n) for n in names}
    make = {n: setups.factory(table[n][1], model.config, model.device) for n in names}
    rows = {n: {"name": n, "what": table[n][0], "ppl": {}, "ppl_delta": {}, "top1": {}, "seconds": 0.0,
                "steps": 0, "retrieval": {}, "ppl_spread": {}} for n in names}
    for kind in kinds:
        ids = multitext.windows(tok, kind, texts_per_kind, prompt + tokens)  # [N, P + M]
        pre = multitext.prefill(model, ids[:, :prompt])
        ref = None
        for n in names:
            cache = seeded.seed(make[n](), pre)
            f = multitext.teacher_forced(model, cache, pre, ids[:, prompt:])
            row = rows[n]
            if "bytes" not in row:
                row["bytes"] = sum(setups.cache_nbytes(cache).values()) // texts_per_kind  # one text's
            _close(cache)
            ref = f if ref is None else ref
            sp = multitext.spread(f.nll, ref.nll)
            row["ppl"][kind] = quality.perplexity(f.nll)
            row["ppl_delta"][kind] = sp["mean"]
            row["ppl_spread"][kind] = sp
            row["top1"][kind] = quality.agreement(f.top1.flatten(), ref.top1.flatten())
            row["seconds"] += f.seconds
            row["steps"] += f.steps
            log(f"{kind:5s} {n:28s} ppl {row['ppl'][kind]:.3f} ({100 * sp['mean']:+.2f}%, 90% "
                f"[{100 * sp['lo']:+.2f}, {100 * sp['hi']:+.2f}], per text "
                + " ".join(f"{100 * d:+.1f}" for d in sp["per_text"]) + f") {f.tok_s:.1f} steps/s")
        if greedy_tokens and kind == kinds[0]:
            pre = seeded.prefill(model, ids[0, :prompt])  # the first text alone
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
    meta = {"prompt": prompt, "tokens": tokens, "texts": list(kinds), "texts_per_kind": texts_per_kind, "greedy_tokens": greedy_tokens,
            "contexts": list(contexts), "depths": list(depths), "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - start, 1)}
    return list(rows.values()), meta
