"""Offload: the ``Offload`` processor (``processor``) that keeps a layer on a host tier.

``processor`` (the processor), ``prefetch`` (the next layers brought in on a side stream),
``mirror`` (the device copy a layer is read from), ``writeback`` (new tokens written back,
deferred), ``disk`` (the disk tier). Offload reaches the device only through the runtime seam
``tiercache.runtime``; its CPU tests run it on the simulated device, ``tiercache.simdevice``.
Torch-only.
"""
