"""The trade-off benchmark on a real model (SmolLM2-135M-Instruct by default), tiercache's
policies and transformers' caches in the same run.

    python bench/bench_real.py                          # the demo size (make demo-real): ~10 min on 2 cores
    python bench/bench_real.py --tokens 256 --contexts 1024,2048,4096,7168 --depths 0.1,0.3,0.5,0.7,0.9
    python bench/bench_real.py --sensitivity            # per-layer int2 cost -> configs/<model>/int2-mixed.yaml
    python bench/bench_real.py --upgrade-search --upgrade 8 --texts-per-kind 4   # keys/values of which layers to give int4
                                                        # -> configs/<model>/int2-keys.yaml
    python bench/bench_real.py --upgrade-search --objective retrieval --contexts 1024,2048 --depths 0.2,0.4,0.6,0.8
                                                        # the pass key's digits instead -> int2-keys-retrieval.yaml
    python bench/bench_real.py --upgrade-search --from-gains a/upgrade_gains.json,b/upgrade_gains.json
                                                        # both searches' gains summed -> int2-keys-both.yaml
    python bench/bench_real.py --upgrade-search --objective joint --contexts 1024,2048,4096 --depths 0.2,0.5,0.8 \
        --candidates-from a/upgrade_gains.json,b/upgrade_gains.json --candidates 10
                                                        # greedy, text and retrieval at once -> int2-keys-joint.yaml
    python bench/bench_real.py --upgrade-search --objective joint ... --start-from out/real/upgrade_greedy.json \
        --upgrade 12 --config-out configs/smollm2-135m/int2-keys-joint12.yaml   # go on from those picks to 12
    python bench/bench_real.py --upgrade-search --int4-k8 out/upgrade/upgrade_gains.json --upgrade 3
                                                        # int8 keys on that search's top 3, meta_bits 8 -> int4-sinks-k8.yaml
    python bench/bench_real.py --upgrade-search --int4-k8 out/upgrade/upgrade_gains.json --steps --candidates 12 \
        --upgrade 3 --texts-per-kind 4 --tokens 256       # of its top 12, the 3 whose int8 keys buy most (step decode)
    python bench/bench_real.py --texts-per-kind 8 --tokens 256 --greedy-tokens 0 --contexts ""   # perplexity, 16 texts

Per setup (``research.realbench``): KV bytes, decode tokens/s (teacher-forced steps),
perplexity on held-out stdlib code and prose after a ``--prompt``-token prefill (``--tokens``
scored per text, one token per step, so every prediction reads the cache as kept), top-1 and
greedy agreement with full precision, and pass-key retrieval at several context lengths and
depths. ``--texts-per-kind N``: N held-out texts of each kind, each setup's perplexity increase
given as the mean over texts with a 90% bootstrap interval (one text is far too noisy to judge a
fraction of a percent). Group 64, residual 128, keys per channel, values per token for every quantized setup.
Writes ``real.md``, ``real.json``, ``real.png`` under ``--out``. Timings share the CPU with
whatever else runs: compare tokens/s within one run only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tiercache

from tiercache.models import registry as builtin  # noqa: E402
from research import multitext, real_report, realbench, retrieval, seeded, sensitivity, texts


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help=f"a built-in name ({', '.join(builtin.NAMES)}) or a path")
    p.add_argument("--setups", default=",".join(realbench.DEFAULT), help="comma-separated names from realbench.SETUPS, or policy YAML paths")
    p.add_argument("--prompt", type=int, default=1024, help="prefill tokens before the scored text")
    p.add_argument("--tokens", type=int, default=128, help="teacher-forced tokens scored per text")
    p.add_argument("--texts", default="code,prose")
    p.add_argument("--texts-per-kind", type=int, default=1,
                   help="held-out texts of each kind, decoded as one batch: mean delta and 90%% bootstrap interval over them")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model, every cache and the texts)")
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--contexts", type=_ints, default=[1024, 4096, 6144], help="retrieval context lengths ('' for none)")
    p.add_argument("--depths", type=_floats, default=[0.3, 0.7])
    p.add_argument("--retrieval-setups", default=None, help="comma-separated: retrieval for these only (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/real")
    p.add_argument("--sensitivity", action="store_true", help="measure per-layer cost and write configs/<model>/int2-mixed.yaml")
    p.add_argument("--upgrade", type=int, default=4, help="--sensitivity: layers kept at int4; --upgrade-search: "
                   "(layer, keys or values) pairs given int4")
    p.add_argument("--config-out", default=None, help="--sensitivity / --upgrade-search: where to write the config "
                   "(default configs/<model>/int2-mixed.yaml / int2-keys.yaml)")
    p.add_argument("--upgrade-search", action="store_true", help="per layer, what int4 keys (or values) buy over "
                   "int2 + sinks everywhere, on train text; writes configs/<model>/int2-keys.yaml")
    p.add_argument("--from-gains", default=None, help="--upgrade-search: no measuring; sum the gains of these "
                   "comma-separated upgrade_gains.json files (e.g. a text and a retrieval search) -> int2-keys-both.yaml")
    p.add_argument("--int4-k8", default=None, metavar="GAINS", help="--upgrade-search: no measuring; int4 + 4 sinks "
                   "with meta_bits 8, and int8 keys on the --upgrade layers whose int4 keys bought the most in this "
                   "saved int2 text search (its upgrade_gains.json) -> int4-sinks-k8.yaml")
    p.add_argument("--steps", action="store_true", help="--int4-k8: measure instead, by step decoding over "
                   "--tokens of train text, what int8 keys buy at int4 on each of that search's top --candidates")
    p.add_argument("--objective", choices=["text", "retrieval", "joint"], default="text", help="--upgrade-search: "
                   "the perplexity of train text, or of the pass key's digits in retrieval samples of --contexts at "
                   "--depths (seed 1: not the keys bench_retrieval.py asks) -> int2-keys-retrieval.yaml; joint: "
                   "both, picked greedily and measured again after each pick -> int2-keys-joint.yaml")
    p.add_argument("--retrieval-tokens", choices=["digits", "first"], default="digits", help="--objective retrieval "
                   "/ joint: score every digit of the pass key, or only its first (where a derailed answer fails)")
    p.add_argument("--candidates-from", default=None, help="--objective joint: choose only among the top "
                   "--candidates (layer, keys or values) of each of these comma-separated upgrade_gains.json files")
    p.add_argument("--candidates", type=int, default=10, help="--candidates-from: how many of each file")
    p.add_argument("--start-from", default=None, help="--objective joint: an earlier run's upgrade_greedy.json; its "
                   "picks are kept and the search goes on from them, to --upgrade picks in all")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    try:
        realbench.setup_names(names)  # before the model loads: a typo costs no conversion
    except ValueError as e:
        print(f"bench_real: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tiercache.models.load import ModelLoadError, load_model

    try:
        model, tok = load_model(args.model, device=args.device)
    except ModelLoadError as e:
        print(f"bench_real: error: {e}", file=sys.stderr)
        return 1
    if args.sensitivity:
        return _sensitivity(model, tok, args)
    if args.upgrade_search:
        return _upgrade_search(model, tok, args)
    rows, meta = realbench.run(model, tok, names, args.prompt, args.tokens, [k for k in args.texts.split(",") if k],
                               args.greedy_tokens, args.contexts, args.depths, retrieval_names=None if
                               args.retrieval_setups is None else args.retrieval_setups.split(","),
                               texts_per_kind=args.texts_per_kind)
    meta.update(model=args.model, device=str(model.device), dtype="float32", torch=torch.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    paths = real_report.write(rows, meta, args.out)
    print()
    print(real_report.markdown(rows, meta))
    print(f"\n{args.model}, {meta['threads']} threads, {meta['seconds']} s; table {paths['md']}, json {paths['json']}, "
          f"plot {paths['png']}")
    return 0


def _sensitivity(model, tok, args) -> int:
    """int2 (sinks + clip) on one layer at a time, on the *train* split (never the evaluation text)."""
    ids = texts.token_ids(tok, "code", args.prompt + args.tokens, split="train")
    pre = seeded.prefill(model, ids[: args.prompt])
    base = {**realbench.K, "bits": 2, "sink_tokens": 4, "clip": "mse"}
    costs = sensitivity.layer_costs(model, pre, ids[args.prompt:], base,
                                    tick=lambda i, c: print(f"layer {i}: {100 * c:+.2f}% perplexity", flush=True))
    policy = sensitivity.mixed(base, costs, {"bits": 4}, args.upgrade, "int2-mixed",
                               f"int2 KIVI with 4 sinks and clipping search; the {args.upgrade} layers whose int2 cache "
                               f"cost the most perplexity on {args.model} (bench/bench_real.py --sensitivity) at int4")
    import yaml

    out = _config_out(args, "int2-mixed.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(policy, sort_keys=False))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sensitivity.json").write_text(json.dumps({"model": args.model, "costs": costs}, indent=1))
    print(f"wrote {out}: layers {policy.get('overrides', [{}])[0].get('layers')} at int4")
    return 0


def _config_out(args, name: str) -> Path:
    if args.config_out is not None:
        return Path(args.config_out)
    return Path(__file__).resolve().parents[1] / "configs" / args.model / name


def _upgrade_search(model, tok, args) -> int:
    """int2 + 4 sinks on every layer; for each layer, int4 keys (or values) there alone: the gain,
    scored in one pass (``sensitivity.one_pass_nll``) on train text (``--texts-per-kind`` of each
    kind), on retrieval samples (``--objective retrieval``), or summed from saved searches
    (``--from-gains``)."""
    if args.int4_k8:
        return _int4_k8(model, tok, args)
    base = {**realbench.K, "bits": 2, "sink_tokens": 4}
    upgrades = {"keys": {"key_bits": 4}, "values": {"value_bits": 4}}
    if args.objective == "joint":
        name = "int2-keys-joint"
        picks = _joint_picks(model, tok, args, base, upgrades)
        policy = sensitivity.policy_of(
            base, [(p["layer"], p["upgrade"]) for p in picks[1:]], upgrades, name,
            f"int2 KIVI with 4 sinks; int4 for {len(picks) - 1} layer keys (or values) picked one at a time, each "
            f"the one that added to the picks before it best lowers train-text and pass-key perplexity together on "
            f"{args.model} (bench/bench_real.py --upgrade-search --objective joint)")
        return _write_search(model, args, name, policy, "upgrade_greedy.json", {"picks": picks})
    if args.from_gains:
        files = [f for f in args.from_gains.split(",") if f]
        name, what = "int2-keys-both", f"summed gain of {len(files)} searches"
        gains = _saved_gains(files, upgrades, model.config.num_hidden_layers)
    elif args.objective == "retrieval":
        name, what = "int2-keys-retrieval", "pass-key perplexity (retrieval samples)"
        gains = _retrieval_gains(model, tok, args, base, upgrades)
    else:
        name, what = "int2-keys", "perplexity"
        gains = _text_gains(model, tok, args, base, upgrades)
    policy = sensitivity.mixed_upgrades(
        base, gains, upgrades, args.upgrade, name,
        f"int2 KIVI with 4 sinks; int4 for the {args.upgrade} layer keys (or values) whose int4 buys the most "
        f"{what} on {args.model} where every other layer is int2 (bench/bench_real.py --upgrade-search)")
    for u, per in gains.items():
        top = sorted(range(len(per)), key=lambda i: -per[i])[:10]
        print(f"{u}: best layers " + ", ".join(f"{i} ({100 * per[i]:+.1f}%)" for i in top))
    return _write_search(model, args, name, policy, "upgrade_gains.json", {"gains": gains})


def _int4_k8(model, tok, args) -> int:
    """int4 + sinks with byte metadata, the bytes saved spent on int8 keys: on the layers whose int4
    keys gained most in a saved int2 search, or (``--steps``) on those of its top ``--candidates``
    whose int8 keys buy the most at int4, measured by step decoding on train text (int4's loss is
    in the recent tokens quantized while decoding, which the one-pass proxy does not see)."""
    base = {**realbench.K, "bits": 4, "sink_tokens": 4, "meta_bits": 8}
    upgrades = {"keys": {"key_bits": 8}}
    ranking = _load_gains(args.int4_k8)["keys"]
    how = "whose int4 keys bought the most perplexity in an int2 search"
    gains, layers = {"keys": ranking}, range(len(ranking))
    if args.steps:
        layers = sorted(range(len(ranking)), key=lambda i: -ranking[i])[: args.candidates]
        items = [(multitext.prefill(model, ids[:, : args.prompt]), ids[:, args.prompt:]) for ids in (
            multitext.windows(tok, kind, args.texts_per_kind, args.prompt + args.tokens, split="train")
            for kind in texts.KINDS)]
        gains = sensitivity.decode_gains(model, items, base, upgrades, layers, tick=lambda i, u, g: print(
            f"layer {i} int8 keys: {100 * g:+.2f}% perplexity gained (step decode, train text)", flush=True))
        how = (f"whose int8 keys buy the most train-text perplexity by step decode, of the {len(layers)} an int2 "
               f"search ranked first")
    picks = sorted(layers, key=lambda i: -gains["keys"][i])[: args.upgrade]  # among the measured only
    policy = sensitivity.policy_of(
        base, [(i, "keys") for i in picks], upgrades, "int4-sinks-k8",
        f"int4 KIVI with 4 sinks, scales and offsets as bytes (meta_bits 8); int8 keys on the {args.upgrade} layers "
        f"{how} on {args.model} (bench/bench_real.py --upgrade-search --int4-k8)")
    measured = [g if i in layers else None for i, g in enumerate(gains["keys"])]  # None: not measured
    return _write_search(model, args, "int4-sinks-k8", policy, "int4_k8.json", {"from": args.int4_k8,
                                                                                   "gains": {"keys": measured}})


def _write_search(model, args, name: str, policy: dict, record: str, found: dict) -> int:
    """Check that ``policy`` loads for the model, write it as the config (named after its file, as a
    config's name is) and ``found`` beside the run."""
    import yaml

    from tiercache import Policy
    from tiercache.models.spec import ModelSpec

    Policy.from_dict(policy).resolve(ModelSpec.from_config(model.config))  # a config that loads, for this model
    out = _config_out(args, f"{name}.yaml")
    policy = {**policy, "name": out.stem}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(policy, sort_keys=False))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / record).write_text(json.dumps({"model": args.model, **found}, indent=1))
    print(f"wrote {out}: {policy.get('overrides')}")
    return 0


def _load_gains(path: str) -> dict:
    """The gains of a saved search (its upgrade_gains.json)."""
    return json.loads(Path(path).read_text())["gains"]


def _saved_gains(files, upgrades, layers: int) -> dict:
    gains = {u: [0.0] * layers for u in upgrades}
    for f in files:
        saved = _load_gains(f)
        gains = {u: [a + b for a, b in zip(gains[u], saved[u])] for u in gains}
    return gains


def _text_items(model, tok, args, kind: str) -> list:
    ids = multitext.windows(tok, kind, args.texts_per_kind, args.prompt + args.tokens, split="train")  # [N, P + M]
    return [(multitext.prefill(model, ids[:, : args.prompt]), ids[:, args.prompt:], None)]


def _retrieval_items(model, tok, args) -> list:
    """Only the pass key's digits count (``--retrieval-tokens first``: its first token only), in samples of
    seed 1 (not the keys bench_retrieval.py asks)."""
    items = []
    for s in retrieval.samples(tok, args.contexts, args.depths, seed=1):
        digits = torch.tensor(texts.encode(tok, " " + s.key))
        counted = torch.ones(len(digits), dtype=torch.bool)
        if args.retrieval_tokens == "first":
            counted[1:] = False  # the first token of the answer only
        mask = torch.cat([torch.zeros(len(s.question), dtype=torch.bool), counted])
        items.append((seeded.prefill(model, s.context), torch.cat([s.question, digits]), mask))
    return items


def _text_gains(model, tok, args, base, upgrades) -> dict:
    """The mean over the two kinds of text of each kind's gains."""
    gains = {u: [0.0] * model.config.num_hidden_layers for u in upgrades}
    for kind in texts.KINDS:
        found = sensitivity.upgrade_gains(model, _text_items(model, tok, args, kind), base, upgrades, tick=lambda i, u, g:
                                          print(f"{kind} layer {i} {u} int4: {100 * g:+.2f}% perplexity gained", flush=True))
        gains = {u: [a + b / len(texts.KINDS) for a, b in zip(gains[u], found[u])] for u in gains}
    return gains


def _retrieval_gains(model, tok, args, base, upgrades) -> dict:
    return sensitivity.upgrade_gains(model, _retrieval_items(model, tok, args), base, upgrades, tick=lambda i, u, g: print(
        f"retrieval layer {i} {u} int4: {100 * g:+.2f}% pass-key perplexity gained", flush=True))


def _joint_picks(model, tok, args, base, upgrades) -> list:
    """Greedy over train text (both kinds, pooled) and retrieval samples, each weighing the same."""
    objectives = {"text": [it for kind in texts.KINDS for it in _text_items(model, tok, args, kind)],
                  "retrieval": _retrieval_items(model, tok, args)}
    candidates = None
    if args.candidates_from:
        candidates = sorted({(i, u) for f in args.candidates_from.split(",") if f for _, i, u in sorted(
            ((g, i, u) for u, per in _load_gains(f).items() for i, g in enumerate(per)), reverse=True)[: args.candidates]})
        print(f"candidates: {candidates}", flush=True)
    print(f"retrieval objective: {len(objectives['retrieval'])} samples, "
          f"{'the first token' if args.retrieval_tokens == 'first' else 'every digit'} of each key", flush=True)

    start = []
    if args.start_from:
        start = [(p["layer"], p["upgrade"]) for p in json.loads(Path(args.start_from).read_text())["picks"][1:]]
        print(f"kept from {args.start_from}: {start}", flush=True)

    def tick(p):
        what = "base (int2 + sinks everywhere)" if p["layer"] is None else f"pick {p['layer']} {p['upgrade']}"
        print(f"{what}: score {p['score']:.3f}, " + ", ".join(f"{o} ppl {v:.4f}" + (
            f" (full precision {p['fp'][o]:.4f})" if "fp" in p else "") for o, v in p["ppl"].items()), flush=True)

    return sensitivity.greedy_upgrades(model, objectives, base, upgrades, args.upgrade - len(start), candidates, tick,
                                       start)

if __name__ == "__main__":
    sys.exit(main())
