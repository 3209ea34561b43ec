"""``tiercache serve``: build the model, store, worker and app from flags, and run uvicorn.

    build(model, policy=None, store=None, no_store=False, persist=None, api_key=None, api_keys=None,
          **worker_options) -> (app, worker)
    main(args) -> exit code       (``tiercache.cli`` calls it with its parsed flags)

``--model`` is loaded by ``tiercache.models.load.load_model`` (``tiny``, ``tiny-random``, a path or a
hub id), on CUDA when present. ``--policy`` is the serving policy (rung 0; default full
precision); ``--store`` the budget and ladder (``configs/serve/store.yaml``; default ``config.DEFAULT_BUDGET`` and ``DEFAULT_LADDER``);
``--no-store`` keeps nothing between requests; ``--persist DIR`` saves entries on shutdown and
loads them (checked) on start (``tiercache.serve.persist``): ``close_store`` saves only once the
worker's thread has ended, and keeps on disk what the start refused. ``--api-key KEY`` (or
``TIERCACHE_API_KEY``) makes every ``/v1`` route ask for ``Authorization: Bearer KEY`` (one
tenant: everyone with the key shares the store). ``--api-keys FILE`` (``tiercache.serve.tenants``)
names several tenants, each with its keys and an optional budget: a tenant's stored conversations
are found only by its own requests (and, within it, only by requests with the same
``cache_salt``). A bad keys file stops the start, before the model is loaded. On the CPU the
packed-attention kernel is loaded before the app starts (``tiercache build-kernels`` builds it).
``--shutdown-timeout S`` (default 30): after SIGTERM / SIGINT, how long the requests already
admitted may run on before they are cancelled (``tiercache.serve.lifecycle``); the store is then
saved and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys

log = logging.getLogger("tiercache.serve")


def build(model: str, policy=None, store=None, no_store: bool = False, persist=None, device=None, api_key=None,
          api_keys=None, **options):
    import torch

    from tiercache.models.load import load_model
    from tiercache.policy.schema import load_policy
    from tiercache.serve.app import create_app
    from tiercache.serve.chat import Codec
    from tiercache.serve.config import load_store_config
    from tiercache.serve.metrics import Metrics
    from tiercache.serve.store import PrefixStore
    from tiercache.serve.worker import Worker

    from tiercache.serve.tenants import load_api_keys

    tenants = load_api_keys(api_keys) if api_keys is not None else None
    serving = load_policy(policy if policy is not None else {"name": "full-precision"})
    config = None if no_store else load_store_config(store)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tok = load_model(model, device=device)
    if torch.device(device).type == "cpu":
        _load_cpu_kernel()
    eos = getattr(getattr(net, "generation_config", None), "eos_token_id", None)
    codec = Codec(tok, eos if isinstance(eos, (list, tuple)) else [eos] if isinstance(eos, int) else [])
    prefix_store = None
    if config is not None:
        prefix_store = PrefixStore([serving, *config.ladder], config.budget,
                                   lambda cache: cache.tier_nbytes(),
                                   block_size=config.block_size, min_match=config.min_match,
                                   tenant_budgets=tenants.budgets if tenants is not None else None)
        if config.remote is not None:  # the shared tier behind the local store
            from tiercache.serve.remote import shared_store

            prefix_store = shared_store(prefix_store, config, net, model, serving)
    metrics = Metrics()
    worker = Worker(net, codec, serving, model_name=model, store=prefix_store, metrics=metrics, **options)
    metrics.attach(worker, prefix_store)
    shutdown = None
    if prefix_store is not None:
        keep = ()
        if persist is not None:
            from tiercache.serve.persist import load_entries

            keep = load_entries(prefix_store, persist, net.config, codec.vocab_size, worker.device).refused
        shutdown = functools.partial(close_store, worker, prefix_store, persist, keep)
    return create_app(worker, metrics, on_shutdown=shutdown, api_key=api_key or None, tenants=tenants), worker


def _load_cpu_kernel() -> None:
    """Loads the packed-attention CPU kernel before the first request (built ahead by ``tiercache
    build-kernels``; ``TIERCACHE_KERNEL_BUILD=lazy`` builds it here, never inside a request); without
    a build, quantized decode uses the torch path, and the start says so once."""
    from tiercache.quantize import packed_cpu

    if packed_cpu.available():
        log.info("packed-attention CPU kernel loaded (%s)", getattr(packed_cpu._STATE["module"], "__file__", "?"))
    elif os.environ.get("TIERCACHE_PACKED_KERNEL", "") != "torch":
        log.warning("packed-attention CPU kernel not built: quantized decode uses the slower torch path "
                    "(run `tiercache build-kernels` once, then restart)")


def close_store(worker, store, persist=None, keep=()) -> None:
    """After ``worker.stop()``: save the entries (``--persist``) and close the store, only once the
    worker's thread has ended. If it is still inside a step, nothing is saved or closed: the
    previous persisted set stays as it was (logged)."""
    if not worker.stopped:
        log.error("shutdown: the worker has not stopped; %s", "nothing saved, the previous persisted set is kept"
                  if persist is not None else "the store is left as it is")
        return
    if persist is not None:
        from tiercache.serve.persist import save_entries

        save_entries(store, persist, keep)
    else:
        store.close()


def main(args) -> int:
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("tiercache serve: error: the server needs its extra: pip install 'tiercache[serve]'", file=sys.stderr)
        return 1
    from tiercache.models.load import ModelLoadError
    from tiercache.errors import PolicyError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.persist is not None and args.no_store:
        print("tiercache serve: error: --persist needs the store; drop --no-store", file=sys.stderr)
        return 1
    if args.step_tokens <= args.max_active:
        print(f"tiercache serve: error: --step-tokens ({args.step_tokens}) must be more than --max-active "
              f"({args.max_active}): a step holds one token of every decoding request plus a prefill chunk",
              file=sys.stderr)
        return 1
    api_key = getattr(args, "api_key", None) or os.environ.get("TIERCACHE_API_KEY") or None
    api_keys = getattr(args, "api_keys", None)
    if api_key is not None and api_keys is not None:
        print("tiercache serve: error: --api-keys names every tenant's keys; drop --api-key (and "
              "$TIERCACHE_API_KEY), or put that key in the file as a tenant", file=sys.stderr)
        return 1
    try:
        app, worker = build(args.model, args.policy, args.store, args.no_store, args.persist,
                            api_key=api_key, api_keys=api_keys,
                            max_active=args.max_active, queue_size=args.queue_size, timeout=args.timeout,
                            prefill_chunk=args.prefill_chunk, step_tokens=args.step_tokens)
    except (ModelLoadError, PolicyError) as e:
        print(f"tiercache serve: error: {e}", file=sys.stderr)
        return 1
    store_state = "off" if worker.store is None else "on" if not hasattr(worker.store, "tier") else "on, with Redis"
    keys = (f"required, {api_keys}: tenants kept apart" if api_keys is not None else "required" if api_key
            else "none: one store for every client")
    log.info("serving %r on http://%s:%d (store: %s, context %d tokens, API key: %s)", args.model, args.host,
             args.port, store_state, worker.context, keys)
    from tiercache.serve.lifecycle import serve

    code = serve(app, args.host, args.port, getattr(args, "shutdown_timeout", 30.0))
    # Everything is saved and closed: run the exit handlers (disk tiers' directories, logging), then
    # leave without the interpreter's teardown of torch and the model (seconds on a busy machine),
    # so that an orchestrator's grace period is spent on the requests and the save.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
