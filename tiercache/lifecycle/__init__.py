"""Caches that outlive one call: fork, retier, save / load (``TieredCache`` delegates here).

    fork(cache) -> TieredCache                 an independent copy (``fork.py``)
    retier(cache, policy)                      move a live cache to another policy (``retier.py``)
    retier_all(caches, policy)                 several as one, all or nothing (an encoder-decoder pair)
    save(cache, path, token_ids) / load(...)   one safetensors file with a JSON header (``persist.py``;
                                               ``cross=``: an encoder-decoder pair in one file)
    AllocationMeter                            peak extra tensor bytes of a block of code (``meter.py``)

Everything here speaks to layers through the layer protocol only (``state_dict`` /
``load_state_dict``, ``export`` / ``ingest``, ``Quantize.adopt``); new chains come from the chain
builder (``tiercache.cache.chain``) from the layer policies the cache's class gives
(``layer_policies(policy, model)``). No transformers import: the cache object is passed in.
"""
