"""Retrieval accuracy per cache setup against full precision, many samples per context length.

Interface
- ``SETUPS``: name -> a transformers baseline name (``setups.BASELINES``), a YAML file under
  ``configs/`` or an inline ``quantize`` mapping; ``DEFAULT``: the names run by default. A setup
  name may also be a policy file of the user's (``setups.check_names``).
- ``run(model, tok, names, contexts, count, fmt="passkey", chat=False, seed=0, log=print, on_sample=None, done=())
  -> list[dict]``: ``count`` samples per context length (depths ``retrieval.spread(count)``, asked
  in ``spread_order``, so a run cut short still covers 0.1-0.9); records in ``done`` (an earlier
  run's, for every setup asked) are kept and their samples not asked again (resume); ``reverse``
  asks that order backwards (a second process on the same length meets the first in the middle);
  each sample is prefilled once (``seeded``) and fed to every setup's cache, which then reads
  the question and decodes. One record per sample: ``context`` (the length asked), ``length``
  (the tokens it has, at most that), ``depth``, ``key``, ``found``
  {setup: bool}, ``answers`` {setup: text}; ``on_sample(records)`` after each (to save progress).
- ``unique(records) -> list[dict]``: one record per sample (context, depth, key), the first kept.
- ``table(records, names) -> list[dict]``: per setup ``by_length`` {context: (found, asked)},
  ``found``, ``asked``, ``acc``, ``delta`` (accuracy minus full precision's, in points) and
  ``kept`` (found, of the samples full precision found).
- ``markdown(records, names, meta) -> str``: that table, full precision first.
"""

from __future__ import annotations

import time

from research import retrieval, seeded
from tiercache.bench import setups

REF = "DynamicCache"
_K = {"backend": "native", "group_size": 64, "residual_length": 128, "key_axis": "channel", "value_axis": "token"}
SETUPS = {
    REF: "dynamic",
    "QuantizedCache quanto int4": "quanto-int4",
    "QuantizedCache quanto int2": "quanto-int2",
    "int4-kivi": "int4-kivi.yaml",
    "int4-sinks": "int4-sinks.yaml",
    "int4 +sinks +clip": {**_K, "bits": 4, "sink_tokens": 4, "clip": "mse"},  # int4-sinks.yaml before it dropped clipping
    "int2 min/max": {**_K, "bits": 2},
    "int2-kivi": "int2-kivi.yaml",
    "int2-sinks": "int2-sinks.yaml",
    "int2 +sinks +clip": {**_K, "bits": 2, "sink_tokens": 4, "clip": "mse"},
}
DEFAULT = tuple(SETUPS)


def _names(names, exist: bool = True) -> list[str]:
    names = setups.check_names(names, SETUPS, exist)
    return [REF, *[n for n in names if n != REF]]  # the reference first


def spread_order(count: int) -> list[int]:
    """Indices 0..count-1, each next one farthest from those taken (0, the last, the middle, ...):
    a run cut short has still asked depths across the whole range."""
    taken = [0]
    while len(taken) < count:
        taken.append(max((i for i in range(count) if i not in taken), key=lambda i: min(abs(i - j) for j in taken)))
    return taken[:count]


def run(model, tok, names, contexts, count: int, fmt: str = "passkey", chat: bool = False, seed: int = 0,
        log=print, on_sample=None, done=(), reverse: bool = False) -> list[dict]:
    names = _names(names)
    make = {n: setups.factory(setups.spec_of(n, SETUPS), model.config) for n in names}
    depths = retrieval.spread(count)
    depths = [depths[i] for i in spread_order(count)][:: -1 if reverse else 1]
    records = [r for r in done if set(names) <= set(r["found"])]
    have = {(r["context"], r["depth"], r["key"]) for r in records}
    todo = [s for s in retrieval.samples(tok, contexts, depths, seed=seed, fmt=fmt, chat=chat)
            if (s.target, s.depth, s.key) not in have]
    for i, sample in enumerate(todo):
        start = time.perf_counter()
        pre = seeded.prefill(model, sample.context)
        rec = {"context": sample.target, "length": sample.length, "depth": sample.depth, "key": sample.key,
               "found": {}, "answers": {}}
        for n in names:
            cache = seeded.seed(make[n](), pre)
            text = retrieval.answer(model, cache, sample, tok)
            if callable(getattr(cache, "close", None)):
                cache.close()
            rec["answers"][n], rec["found"][n] = text, retrieval.found(text, sample.key)
        records.append(rec)
        log(f"[{i + 1}/{len(todo)}] {sample.length} tokens, depth {sample.depth:.2f}, key {sample.key}: "
            f"full precision {rec['answers'][REF]!r}; found by "
            f"{', '.join(n for n in names if rec['found'][n]) or 'none'} ({time.perf_counter() - start:.0f} s)")
        if on_sample is not None:
            on_sample(records)
    return records


def unique(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in records:
        if (r["context"], r["depth"], r["key"]) not in seen:
            seen.add((r["context"], r["depth"], r["key"]))
            out.append(r)
    return out


def table(records: list[dict], names) -> list[dict]:
    rows = []
    for n in names:
        by: dict[int, tuple[int, int]] = {}
        for r in records:
            if n in r["found"]:
                got, asked = by.get(r["context"], (0, 0))
                by[r["context"]] = (got + bool(r["found"][n]), asked + 1)
        got, asked = sum(g for g, _ in by.values()), sum(a for _, a in by.values())
        rows.append({"name": n, "by_length": dict(sorted(by.items())), "found": got, "asked": asked,
                     "acc": got / asked if asked else None})
    ref = next((r["acc"] for r in rows if r["name"] == REF), None)
    for r in rows:
        r["delta"] = None if r["acc"] is None or ref is None else 100 * (r["acc"] - ref)
        hits = [x for x in records if x["found"].get(REF) and r["name"] in x["found"]]
        r["kept"] = (sum(bool(x["found"][r["name"]]) for x in hits), len(hits))
    return rows


def _cell(got: int, asked: int) -> str:
    return f"{got}/{asked} ({100 * got / asked:.0f}%)" if asked else ""


def markdown(records: list[dict], names, meta: dict) -> str:
    rows = table(records, _names(names, exist=False))  # a merge of earlier runs: the files may have moved
    lengths = sorted({r["context"] for r in records})
    head = ["setup", *[f"{n} tokens" for n in lengths], "all", "Δ vs full precision (points)",
            "of full precision's hits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], *[_cell(*r["by_length"].get(n, (0, 0))) for n in lengths], _cell(r["found"], r["asked"]),
                 "" if r["delta"] is None else f"{r['delta']:+.1f}", _cell(*r["kept"])]
        lines.append("| " + " | ".join(cells) + " |")
    per = {n: sum(1 for r in records if r["context"] == n) for n in lengths}
    note = (f"Format {meta.get('format', 'passkey')!r}{' (chat template)' if meta.get('chat') else ''}, found / asked; "
            f"samples per context length: {', '.join(f'{n}: {k}' for n, k in per.items())} (depths 0.1-0.9, one key "
            f"each; a context holds up to that many tokens, question included).")
    return note + "\n\n" + "\n".join(lines)
