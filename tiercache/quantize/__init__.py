"""Quantization: the ``Quantize`` processor (``processor``) and its parts.

``processor`` (the processor: residual window, blocks appended, never re-quantized), ``state``
(its state_dict / export / ingest), ``crop`` (crops and batch selection on quantized state),
``residual`` (the full-precision window), ``blocks`` (packed blocks), ``codec`` (a block format),
``metacodes`` (scales and offsets stored in 8 bits), ``geometry`` (group shapes), ``finite``
(the deferred non-finite check), ``backends/`` (native, quanto, hqq; a registry by name, imported
lazily). Torch-only.
"""
