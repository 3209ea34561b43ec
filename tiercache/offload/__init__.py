"""Offload: the ``Offload`` processor (``processor``) that keeps a layer on a host tier.

``processor`` (the processor), ``prefetch`` (the next layers brought in on a side stream),
``mirror`` (the device copy a layer is read from), ``writeback`` (new tokens written back,
deferred), ``disk`` (the disk tier), ``simdevice`` / ``simmemory`` (a deterministic simulated
device for CPU tests, an implementation of the device runtime seam ``tiercache.runtime``).
Torch-only.
"""
