"""Caches that outlive one call: save / load (``TieredCache.save`` / ``load`` delegate here).

    save(cache, path, token_ids) / load(...)   one safetensors file with a JSON header (``persist.py``;
                                               ``cross=``: an encoder-decoder pair in one file)
    bounds                                     what a load may allocate, where disk files may go (``bounds.py``)
    AllocationMeter                            peak extra tensor bytes of a block of code (``meter.py``)

Everything here speaks to layers through the layer protocol only (``state_dict`` /
``load_state_dict``); the cache object and its class are passed in, so this package sits below
``tiercache.cache`` and imports nothing of it. ``fork`` and ``retier``, which build new chains
with the chain builder, are in ``tiercache.cache`` (``fork.py``, ``retier.py``). No transformers
import.
"""
