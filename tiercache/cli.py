"""The ``tiercache`` command: validate, plan, generate, bench, serve, build-kernels.

    tiercache validate POLICY [--model M]           OK, or the PolicyError; exit 0 / 1
    tiercache plan POLICY --model M --context N --batch B [--weights int4] [--device cpu] [--prefill-chunk N]
                   [--encoder-length N]            (encoder-decoder models: cross-attention K/V counted)
                   [--gpu-memory 24GB]             (the card: the whole footprint must fit it)
    tiercache generate --model M --policy POLICY (--prompt TEXT | --prompt-file F) [--max-new-tokens N]
                       [--prefill-chunk N] [--chat | --no-chat]
                                                    chunked prefill (tiercache.cache.prefill), then decode
    tiercache bench [...]                           the trade-off benchmark (see tiercache.bench)
    tiercache tune --model M --context N (--budget SIZE | --max-kld X) [--text FILE ...] [--out policy.yaml]
                                                    a policy for this model and budget by measurement
    tiercache check POLICY --model M [--text FILE ...] [--max-kld X]
                                                    KLD, perplexity, top-1, pass key vs full precision; exit 1 past it
                                                    (both: tiercache.tune.command)
    tiercache serve --model M [--policy P] [--store S] [--host H] [--port N] [--no-store] [--persist DIR]
                    [--api-key KEY | --api-keys FILE] [--max-active N] [--prefill-chunk N] [--step-tokens N]
                    [--shutdown-timeout S]
                                                    the OpenAI-compatible server (tiercache.serve)
    tiercache build-kernels [--dir DIR] [--check] [--verbose]
                                                    compile the C++ CPU kernels once (tiercache.quantize.kernel_build)

``--model`` takes a built-in name (``tiercache.models.registry``: ``tiny``, the trained tiny model,
no network; ``tiny-random``; ``smollm2-135m``, SmolLM2-135M-Instruct from the ``real`` extra), a
preset shape for ``plan`` / ``validate`` (``Llama-3-8B`` ...), a local path or a hub id.
``generate`` needs weights, so it takes no preset. It wraps the prompt in the model's chat
template (one user turn, then the assistant's turn) when the tokenizer has one; ``--no-chat``
feeds the raw text, ``--chat`` insists (an error when there is no template).

Errors: ``tiercache <command>: error: ...`` on stderr and exit 1 (``validate`` prints the
PolicyError on stdout, as its answer); malformed flag values are argparse's usage errors (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import time

from tiercache.argtypes import non_negative_int, positive_int, positive_seconds
from tiercache.errors import CacheError, PolicyError
from tiercache.planner.units import card_size
from tiercache.planner.weights import FORMATS


def _error(command: str, message: str) -> int:
    print(f"tiercache {command}: error: {message}", file=sys.stderr)
    return 1


def _validate(args) -> int:
    from tiercache.policy.schema import load_policy

    try:
        policy = load_policy(args.policy)
        if args.model:
            from tiercache.planner.api import resolve_model

            policy.resolve(resolve_model(args.model))
    except PolicyError as e:
        print(f"{args.policy}: {e}")
        return 1
    print(f"OK: {args.policy} ({policy.name}{': ' + policy.description if policy.description else ''})")
    return 0


def _plan(args) -> int:
    from tiercache.planner.api import main_plan

    return main_plan(args.policy, args.model, args.context, args.batch, encoder_length=args.encoder_length,
                     weights=args.weights, device=args.device, prefill_chunk=args.prefill_chunk,
                     gpu_memory=args.gpu_memory)


def _generate(args) -> int:
    import torch

    from tiercache.models.tiny import ByteTokenizer
    from tiercache.models.load import ModelLoadError, load_model
    from tiercache.cache.tiered import TieredCache

    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            prompt = open(args.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            return _error("generate", f"--prompt-file {args.prompt_file!r} cannot be read as UTF-8 text: {e}")
    if not prompt:
        source = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file!r}"
        return _error("generate", f"{source} is empty; give the text to continue (at least one character)")
    from tiercache.planner.hostmem import release_freed_memory

    release_freed_memory()  # freed activations go back to the OS: the peak is what is held (hostmem.py)
    torch.manual_seed(args.seed)
    try:
        model, tok = load_model(args.model)
    except ModelLoadError as e:
        return _error("generate", str(e))
    chat = getattr(tok, "chat_template", None) is not None if args.chat is None else args.chat
    if chat and getattr(tok, "chat_template", None) is None:
        return _error("generate", f"--chat: model {args.model!r} has no chat template; drop --chat")
    if isinstance(tok, ByteTokenizer):
        ids = torch.tensor([tok.encode(prompt)], dtype=torch.long)  # [1, T]
    elif chat:  # the prompt as one user turn, then the assistant's turn begins
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        return _error("generate", f"the prompt {prompt[:40]!r} encodes to no tokens with this model's tokenizer")
    context = ids.shape[1] + args.max_new_tokens
    try:
        cache = TieredCache.from_policy(args.policy, model.config, context_length=context)
        from tiercache.planner.api import plan

        planned = plan(cache.policy, model, 1, context, device="cpu", prefill_chunk=args.prefill_chunk)
    except PolicyError as e:
        return _error("generate", str(e))
    from tiercache.cache.prefill import generate

    start = time.perf_counter()
    out = generate(model, ids, cache, prefill_chunk=planned.prefill_chunk, max_new_tokens=args.max_new_tokens,
                   do_sample=args.sample, pad_token_id=getattr(tok, "pad_token_id", None))
    elapsed = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    new_ids = out[0, ids.shape[1]:]
    print(tok.decode(new_ids) if isinstance(tok, ByteTokenizer) else tok.decode(new_ids, skip_special_tokens=True))
    print("---")
    sizes = ", ".join(f"{place}: {n / 2**20:.2f} MiB" for place, n in sorted(cache.nbytes().items()))
    print(f"policy {cache.policy.name}: {ids.shape[1]} prompt tokens (prefill chunks of {planned.prefill_chunk}), "
          f"{new} new tokens in {elapsed:.2f}s ({new / elapsed:.1f} tokens/s, prefill included); cache {sizes or 'empty'} for {cache.get_seq_length()} tokens")
    print(f"memory: planned total {sum(planned.whole.total.values()) / 2**20:.1f} MiB, "
          f"peak RSS {_peak_rss() / 2**20:.1f} MiB")
    cache.close()
    return 0


def _peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _serve(args) -> int:
    from tiercache.serve.server import main as serve_main

    return serve_main(args)


def _build_kernels(args) -> int:
    """Builds every C++ kernel for this torch and CPU (or, with ``--check``, says whether each is built)."""
    import os

    if args.dir is not None:
        os.environ["TIERCACHE_KERNEL_DIR"] = args.dir
    from tiercache.quantize import kernel_build

    status = 0
    from tiercache.quantize import packed_cpu

    for kernel in (packed_cpu.kernel(),):  # every C++ kernel tiercache ships
        if args.check:
            path = kernel_build.locate(kernel)
            print(f"{kernel.name}: {'built in ' + str(path) if path else 'not built (looked for ' + str(kernel_build.root() / kernel_build.key(kernel)) + ')'}")
            status = status or (0 if path else 1)
            continue
        if kernel_build.locate(kernel) is None and kernel_build.compiler() is not None:
            print(f"{kernel.name}: compiling (about a minute) into {kernel_build.root()} ...", flush=True)
        try:
            built = kernel_build.build(kernel, verbose=args.verbose)
        except kernel_build.KernelBuildError as e:
            return _error("build-kernels", str(e))
        if built.compiled:
            print(f"{kernel.name}: built in {built.seconds:.1f}s into {built.path}")
        else:
            print(f"{kernel.name}: already built in {built.path} (found in {built.seconds:.2f}s)")
    return status


def _tune(args) -> int:
    from tiercache.tune.command import run_tune

    return run_tune(args)


def _check(args) -> int:
    from tiercache.tune.command import run_check

    return run_check(args)


def _bench(args, rest: list[str]) -> int:
    from tiercache.bench import main

    return main(rest)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache", description="A memory-tiered KV cache for LLM generation.")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a policy file")
    v.add_argument("policy")
    v.add_argument("--model", help="also check overrides against this model (tiny, tiny-random, smollm2-135m, preset, path or hub id)")
    pl = sub.add_parser("plan", help="bytes per tier of a policy for a model, context and batch")
    pl.add_argument("policy")
    pl.add_argument("--model", required=True,
                    help="tiny, tiny-random, smollm2-135m, a preset (Llama-3-8B ...), a path or hub id")
    pl.add_argument("--context", type=positive_int, required=True)
    pl.add_argument("--batch", type=positive_int, default=1)
    pl.add_argument("--weights", choices=FORMATS, default=None, help="weights format (default: the model's dtype)")
    pl.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="compute device (default: cuda when --gpu-memory or the policy's budget.gpu_memory states "
                         "a card or this machine has CUDA, else cpu; the plan's first line says which)")
    pl.add_argument("--prefill-chunk", type=positive_int, default=None,
                    help="prompt tokens one forward feeds at most, the prefill chunk planned for (default: the largest "
                         "that fits a scope: total budget, else 2048)")
    pl.add_argument("--encoder-length", type=positive_int, default=None,
                    help="encoder-decoder models: encoder output tokens, to count cross-attention K/V")
    pl.add_argument("--gpu-memory", type=card_size, default=None, metavar="SIZE",
                    help="the card's memory, e.g. 24GB (10^9 bytes, as cards are sold) or 22.35GiB (2^30): the "
                         "verdict then also needs the whole footprint to fit it (default: the policy's "
                         "budget.gpu_memory, if any)")
    g = sub.add_parser("generate", help="generate text with a policy")
    g.add_argument("--model", default="tiny",
                   help="tiny (default), tiny-random, smollm2-135m (the 'real' extra), a local model directory or a hub id")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template as a user turn (default: when the model has one)")
    g.add_argument("--policy", default=None, help="policy YAML (default: full precision)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", help="read the text to continue from this UTF-8 file (long prompts)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="prompt tokens one forward feeds at most, the prefill chunk (default: the plan's, tiercache plan)")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--sample", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="the trade-off benchmark (flags: tiercache bench --help)", add_help=False)
    from tiercache.tune.command import add_check, add_tune

    add_tune(sub)
    add_check(sub)
    s = sub.add_parser("serve", help="an OpenAI-compatible server that keeps conversations' KV caches")
    s.add_argument("--model", default="tiny", help="tiny (default), tiny-random, a local model directory or a hub id")
    s.add_argument("--policy", default=None, help="serving policy YAML (rung 0; default: full precision)")
    s.add_argument("--store", default=None, help="store YAML: budget per tier and demotion ladder (configs/serve/store.yaml)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=positive_int, default=8000)
    s.add_argument("--no-store", action="store_true", help="keep nothing between requests (prefill everything)")
    s.add_argument("--persist", default=None, metavar="DIR", help="save stored entries here on shutdown, load on start")
    s.add_argument("--max-active", type=positive_int, default=8,
                   help="requests generated at once (one forward per step over all of them)")
    s.add_argument("--prefill-chunk", type=positive_int, default=256,
                   help="prompt tokens one forward (a step) feeds at most, the prefill chunk, beside the decoding "
                        "requests (default 256)")
    s.add_argument("--step-tokens", type=positive_int, default=512,
                   help="tokens one step feeds at most: one per decoding request + the prefill chunk (default 512; "
                        "more than --max-active)")
    s.add_argument("--queue-size", type=positive_int, default=32, help="requests waiting before 429")
    s.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds a request may take, queue included (a number > 0; default 600)")
    s.add_argument("--shutdown-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="after SIGTERM/SIGINT: seconds the running requests may take before they are cancelled, "
                        "then the store is saved and the server exits 0 (default 30; a second signal exits at once)")
    keys = s.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1 routes: one tenant, every client shares the "
                           "store (default: $TIERCACHE_API_KEY, else no key)")
    keys.add_argument("--api-keys", default=None, metavar="FILE",
                      help="YAML: tenant name -> {key: SECRET} or {keys: [...]}, optional budget: SIZE; a tenant's "
                           "stored conversations are found only by its own requests (docs/serving-api.md)")
    k = sub.add_parser("build-kernels", help="compile the C++ CPU kernels once for this torch and CPU (about a minute)")
    k.add_argument("--dir", default=None, help="where builds live (default: $TIERCACHE_KERNEL_DIR, else "
                                               "~/.cache/tiercache/kernels); runs look there through TIERCACHE_KERNEL_DIR")
    k.add_argument("--check", action="store_true", help="build nothing: say whether each kernel is built (exit 1 if not)")
    k.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(None, argv[1:])
    args = parser().parse_args(argv)
    if args.command == "generate" and args.policy is None:
        args.policy = {"name": "full-precision"}
    try:
        return {"validate": _validate, "plan": _plan, "generate": _generate, "serve": _serve, "tune": _tune,
                "check": _check, "build-kernels": _build_kernels}[args.command](args)
    except CacheError as e:
        return _error(args.command, str(e))


if __name__ == "__main__":
    sys.exit(main())
