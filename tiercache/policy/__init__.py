"""Policies: ``schema`` (the frozen dataclasses, ``load_policy``, their checks) and ``fields`` (the
one generic loader and the field types it knows: sizes, ``UNSET``). Torch-free."""

from tiercache.policy.schema import LayerPolicy, OffloadPolicy, Policy, QuantizePolicy, load_policy

__all__ = ["LayerPolicy", "OffloadPolicy", "Policy", "QuantizePolicy", "load_policy"]
