"""Caches that outlive one call: fork, retier, save / load (``TieredCache`` delegates here).

    fork(cache) -> TieredCache                 an independent copy (``fork.py``)
    retier(cache, policy)                      move a live cache to another policy (``retier.py``)
    save(cache, path, token_ids) / load(...)   one safetensors file with a JSON header (``persist.py``)
    AllocationMeter                            peak extra tensor bytes of a block of code (``meter.py``)

Everything here speaks to layers through the layer protocol only (``state_dict`` /
``load_state_dict``, ``export`` / ``ingest``, ``Quantize.adopt``); new chains come from the chain
builder (``tiercache.chain``). No transformers import: the cache object is passed in.
"""
