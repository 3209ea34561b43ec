"""``tiercache serve``: build the model, store, worker and app from flags, and run uvicorn.

    build(model, policy=None, store=None, no_store=False, persist=None, **worker_options) -> (app, parts)
    main(args) -> exit code       (``tiercache.cli`` calls it with its parsed flags)

``--model`` is loaded by ``tiercache.bench.tiny.load_model`` (``tiny``, ``tiny-random``, a path or a
hub id), on CUDA when present. ``--policy`` is the serving policy (rung 0; default full
precision); ``--store`` the budget and ladder (``configs/serve/store.yaml``; default ``config.DEFAULT``);
``--no-store`` keeps nothing between requests; ``--persist DIR`` saves entries on shutdown and
loads them (checked) on start.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("tiercache.serve")


def build(model: str, policy=None, store=None, no_store: bool = False, persist=None, device=None, **options):
    import torch

    from tiercache.bench.tiny import load_model
    from tiercache.policy import load_policy
    from tiercache.serve.app import create_app
    from tiercache.serve.chat import Codec
    from tiercache.serve.config import load_store_config
    from tiercache.serve.metrics import Metrics
    from tiercache.serve.store import PrefixStore
    from tiercache.serve.worker import Worker

    serving = load_policy(policy if policy is not None else {"name": "full-precision"})
    config = None if no_store else load_store_config(store)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tok = load_model(model, device=device)
    eos = getattr(getattr(net, "generation_config", None), "eos_token_id", None)
    codec = Codec(tok, eos if isinstance(eos, (list, tuple)) else [eos] if isinstance(eos, int) else [])
    prefix_store = None
    if config is not None:
        prefix_store = PrefixStore([serving, *config.ladder], config.budget,
                                   lambda cache: cache.tier_nbytes(),
                                   block_size=config.block_size, min_match=config.min_match)
        if config.remote is not None:  # the shared tier behind the local store
            from tiercache.serve.remote import shared_store

            prefix_store = shared_store(prefix_store, config, net, model, serving)
    metrics = Metrics()
    worker = Worker(net, codec, serving, model_name=model, store=prefix_store, metrics=metrics, **options)
    metrics.attach(worker, prefix_store)
    shutdown = None
    if persist is not None and prefix_store is not None:
        from tiercache.serve.persist import load_entries, save_entries

        load_entries(prefix_store, persist, net.config, codec.vocab_size, worker.device)
        shutdown = lambda: save_entries(prefix_store, persist)  # noqa: E731
    elif prefix_store is not None:
        shutdown = prefix_store.close
    return create_app(worker, metrics, on_shutdown=shutdown), worker


def main(args) -> int:
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("tiercache serve: error: the server needs its extra: pip install 'tiercache[serve]'", file=sys.stderr)
        return 1
    from tiercache.bench.tiny import ModelLoadError
    from tiercache.errors import PolicyError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.persist is not None and args.no_store:
        print("tiercache serve: error: --persist needs the store; drop --no-store", file=sys.stderr)
        return 1
    try:
        app, worker = build(args.model, args.policy, args.store, args.no_store, args.persist,
                            max_active=args.max_active, queue_size=args.queue_size, timeout=args.timeout)
    except (ModelLoadError, PolicyError) as e:
        print(f"tiercache serve: error: {e}", file=sys.stderr)
        return 1
    log.info("serving %r on http://%s:%d (store: %s, context %d tokens)", args.model, args.host, args.port,
             "off" if worker.store is None else "on" if not hasattr(worker.store, "tier") else "on, with Redis",
             worker.context)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
