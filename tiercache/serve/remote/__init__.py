"""The remote tier: stored conversations as chunks in Redis (or Valkey), shared by servers.

Modules, from the face down (imports flow that way):
- ``store``      the rung logic: a local ``PrefixStore`` in front, the tier behind, one store interface
- ``tier``       lookup (longest run of stored chunks), background writes, fault handling, counters
- ``codec``      one chunk as one blob: header + payload (packed when quantized) + sha256, or an
                 HMAC-SHA256 under ``remote.secret``; no pickle
- ``keys``       chained sha256 chunk keys (a tenant's scope hashed in), the model fingerprint
- ``connector``  exists / get / set over redis-py, nothing else
- ``config``     the ``remote:`` section of ``store.yaml`` (needs no Redis client)
- ``metrics``    the tier's Prometheus families for ``/metrics``

    store = shared_store(local, store_config, model, name, policy)    (``tiercache serve`` calls it)

Only this package imports redis (``pip install 'tiercache[remote]'``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("tiercache.serve")


def shared_store(local, config, model, name: str, policy):
    """``local`` (a ``PrefixStore``) behind a ``SharedStore`` with the tier of ``config.remote``;
    ``PolicyError`` when the model or the environment cannot have one (named)."""
    from tiercache.errors import PolicyError
    from tiercache.serve.remote.store import SharedStore
    from tiercache.serve.remote.tier import RemoteTier

    try:
        tier = RemoteTier.for_model(config.remote, model, name, policy, min_match=config.min_match)
    except (ValueError, ImportError) as e:
        raise PolicyError(str(e)) from e
    tier.probe()  # logged either way; a missing Redis is never fatal
    return SharedStore(local, tier, write=config.remote.write, remote_rung=config.remote_rung)
