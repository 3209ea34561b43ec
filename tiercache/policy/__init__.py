"""Policies: ``schema`` (the frozen dataclasses, ``load_policy``, their checks), ``fields`` (the
one generic loader and the field types it knows: sizes, ``UNSET``) and ``backends`` (what each
quantization backend accepts: names, bits, formats, packages). Torch-free."""

from tiercache.policy.schema import LayerPolicy, OffloadPolicy, Policy, QuantizePolicy, load_policy

__all__ = ["LayerPolicy", "OffloadPolicy", "Policy", "QuantizePolicy", "load_policy"]
