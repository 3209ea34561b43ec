"""The ``tiercache tune`` and ``tiercache check`` commands.

    tiercache tune --model M --context N (--budget SIZE | --max-kld X) [--text FILE ...] [--batch B]
                   [--out policy.yaml] [--calibration FILE] [--frontier STEM] [--time-budget SECONDS]
                   [--stretch S] [--sinks N] [--residual N] [--no-passkey] [--no-progress]
    tiercache check POLICY --model M [--text FILE ...] [--context N] [--max-kld X] [--max-ppl-change X]
                   [--no-passkey]

``tune``: calibration (``calibrate``; skipped when ``--calibration FILE`` exists, written there
otherwise, default ``<out>.sensitivity.json``), the uniform formats measured, the search
(``search``), the policy YAML (``--out``, default ``tuned.yaml``) and the frontier
(``<out>.frontier.md`` / ``.json`` / ``.png`` unless ``--frontier``). ``--budget`` is the cache's
own bytes at ``--context`` and ``--batch`` (``tiercache plan``'s, all tiers); ``int8`` / ``int4`` /
``int2`` there mean the bytes of that uniform format. Exit 0 when the chosen policy meets the
request (within the budget, KLD at most ``--max-kld``, every pass key full precision finds),
1 otherwise or on an error.

``check``: one policy measured like tune's verification, on the same text (the second half of
``--text``, or the built-in held-out text): KLD, perplexity change, top-1 agreement and pass-key
retrieval against full precision. Exit 1 when a given threshold is passed or the policy finds
fewer pass keys than full precision (``--no-passkey`` skips that probe), 0 otherwise.

Both take ``--model`` as ``generate`` does (``tiny``, ``smollm2-135m``, a path or hub id).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tiercache.argtypes import non_negative_int, positive_int
from tiercache.errors import PolicyError

from tiercache.tune.inputs import UNIFORM_NAMES, setup


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not x > 0 or x != x or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def budget_arg(text: str):
    if text.strip().lower() in UNIFORM_NAMES:
        return text.strip().lower()
    from tiercache.policy.fields import parse_size

    try:
        n = parse_size(text, "--budget")
    except PolicyError as e:
        raise argparse.ArgumentTypeError(f"{e}; or int8 / int4 / int2 for that uniform format's bytes") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a size > 0, got {text!r}")
    return int(n)


def add_tune(sub) -> None:
    t = sub.add_parser("tune", help="find the policy for this model and budget by measurement")
    t.add_argument("--model", default="tiny", help="tiny (default), smollm2-135m, a local model directory or a hub id")
    t.add_argument("--context", type=positive_int, required=True, help="tokens the cache holds")
    goal = t.add_mutually_exclusive_group(required=True)
    goal.add_argument("--budget", type=budget_arg,
                      help="the cache's own bytes at --context and --batch (e.g. 24MiB), or int8 / int4 / int2 for "
                           "that uniform format's bytes: the least KLD within it")
    goal.add_argument("--max-kld", type=positive_float, help="the fewest bytes whose measured KLD is at most this (nats)")
    t.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text to calibrate on (first part) and verify on (last part); default: built-in text")
    t.add_argument("--batch", type=positive_int, default=1)
    t.add_argument("--out", default="tuned.yaml", help="the policy YAML to write (default tuned.yaml)")
    t.add_argument("--calibration", default=None, metavar="FILE",
                   help="sensitivity JSON: read when it exists (no calibration), else written (default: <out>.sensitivity.json)")
    t.add_argument("--frontier", default=None, metavar="STEM", help="frontier table and plot (default: <out>.frontier)")
    t.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                   help="stop with an error when calibration and search run past this")
    t.add_argument("--stretch", type=positive_int, default=128, help="tokens scored after the prefix (default 128)")
    t.add_argument("--sinks", type=non_negative_int, default=None, help="fix the attention-sink tokens (default: measured)")
    t.add_argument("--residual", type=positive_int, default=None, help="fix the residual (default: measured)")
    t.add_argument("--no-passkey", action="store_true", help="skip the pass-key probe in verification")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")


def add_check(sub) -> None:
    c = sub.add_parser("check", help="measure a policy against full precision; exit 1 past a threshold")
    c.add_argument("policy")
    c.add_argument("--model", default="tiny", help="tiny (default), smollm2-135m, a local model directory or a hub id")
    c.add_argument("--text", nargs="+", default=None, metavar="FILE", help="UTF-8 text (its last part is read)")
    c.add_argument("--context", type=positive_int, default=2048, help="tokens the cache holds (default 2048)")
    c.add_argument("--stretch", type=positive_int, default=128, help="tokens scored after the prefix (default 128)")
    c.add_argument("--max-kld", type=positive_float, default=None, help="fail when the KLD (nats) is above this")
    c.add_argument("--max-ppl-change", type=positive_float, default=None,
                   help="fail when perplexity rises by more than this fraction (0.05: 5%%)")
    c.add_argument("--no-passkey", action="store_true", help="skip the pass-key probe")
    c.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")


def _error(command: str, message: str) -> int:
    print(f"tiercache {command}: error: {message}", file=sys.stderr)
    return 1


def run_check(args) -> int:
    from tiercache.policy.schema import load_policy
    from tiercache.tune.report import figures_text
    from tiercache.tune.verify import Verifier

    started = time.perf_counter()
    try:
        policy = load_policy(args.policy)
        model, tok, wins, source = setup(args)
        from tiercache.models.spec import ModelSpec

        policy.resolve(ModelSpec.from_config(model.config))
    except (PolicyError, ValueError) as e:
        return _error("check", str(e))
    verifier = Verifier(model, tok, wins[-1], args.stretch, passkey=not args.no_passkey)
    f = verifier.measure(policy)
    print(f"{args.policy} on {args.model}, context {args.context}, {args.stretch} tokens scored ({source}):")
    print("  " + figures_text(f))
    failed = []
    if args.max_kld is not None and f.kld > args.max_kld:
        failed.append(f"KLD {f.kld:.5f} > --max-kld {args.max_kld}")
    if args.max_ppl_change is not None and f.ppl_change > args.max_ppl_change:
        failed.append(f"perplexity change {f.ppl_change:+.4f} > --max-ppl-change {args.max_ppl_change}")
    if f.passkey is not None and f.passkey[0] < f.passkey_ref[0]:
        failed.append(f"pass key found {f.passkey[0]}/{f.passkey[1]}, full precision {f.passkey_ref[0]}/{f.passkey_ref[1]}")
    print(f"  ({time.perf_counter() - started:.1f} s)")
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("PASS")
    return 0


def run_tune(args) -> int:
    from tiercache.tune.session import TuneError, tune

    try:
        return tune(args)
    except TuneError as e:
        return _error("tune", str(e))
