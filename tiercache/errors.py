"""The two errors tiercache raises on bad input.

``PolicyError``: a policy (YAML, dict or dataclass) is invalid for the schema or for the model.
``CacheError``: a tensor handed to the cache does not fit what the layer holds, or an operation
is impossible (cropping past what a sliding layer kept, exceeding a static ``max_length`` ...).
Both are ``ValueError``s; both leave the cache exactly as it was.
"""


class PolicyError(ValueError):
    """A policy field is invalid: the message names the field path, the value and what is allowed."""


class CacheError(ValueError):
    """An update or cache operation cannot be applied; the cache is unchanged."""
