"""``tiercache serve``: an OpenAI-compatible server that keeps each conversation's KV cache.

Modules, from the face down (imports flow that way):
- ``app``       FastAPI routes, body checks, SSE streaming, OpenAI-style errors (the only fastapi user)
- ``protocol``  request fields -> a validated ``Request`` (types, ranges, unsupported fields)
- ``fields``    every documented OpenAI field: served, inert, or neutral-only (refused by name otherwise)
- ``responses`` OpenAI response objects: choices, chunks, log-probabilities, usage, system_fingerprint
- ``worker``    one thread owns the model; each step one forward over every active request (a bounded queue)
- ``sequence``  one request's generation: prefill from the store a chunk per step, decode, stop, hand back;
                n choices forked
- ``sampling``  the next token of one sequence: penalties, logit_bias, temperature / top_p, seed, logprobs
- ``batch``     one packed forward over several sequences, attention per sequence against its own cache
- ``chat``      messages -> prompt text (the tokenizer's chat template, else a plain fallback)
- ``text``      incremental detokenization with stop strings held back
- ``store``     the prefix store: longest stored prefix, budgets per tier, LRU, demotion, eviction
- ``radix``     the trie over token blocks the store looks prefixes up in
- ``tenants``   API keys -> tenants (``--api-keys``), the scope (tenant, ``cache_salt``) entries are filed under
- ``config``    ``store.yaml``: budgets and the demotion ladder
- ``persist``   entries saved on shutdown and loaded (checked) on start
- ``remote/``   the shared tier: chunks in Redis behind the store (``store.yaml`` ``remote:``; docs/remote.md)
- ``metrics``   Prometheus text for ``/metrics``
- ``errors``    ``APIError``: status, message, type, param, code
- ``server``    flags -> model, store, worker, app; uvicorn (``tiercache serve``)
- ``launch``    ``LiveServer``: a server subprocess on loopback (tests, ``bench/bench_serve.py``)

Only this package imports fastapi / uvicorn / prometheus_client (``pip install tiercache[serve]``),
and only ``remote/`` imports redis (``pip install tiercache[remote]``).
"""
