"""The simulated device: a deterministic implementation of the device runtime seam
(``tiercache.runtime``) on the CPU, where a copy lands only when its stream is advanced past it, so
the CPU tests exercise every ordering call of offload's CUDA path (``bench/mutate_ordering.py``
checks that each one is needed).

    with simulated(devices=1) as sim: ...   installs it for a block; ``sim.hazards`` are the races seen
    Sim                                     the simulated runtime and its state

``device`` (the runtime, its dispatch mode, ``simulated``), ``memory`` (arenas, streams, events,
queued ops). Torch-only. The library reaches the device through the seam alone and never imports this package
(the tests and ``bench/`` do; the deprecated aliases ``tiercache.offload.simdevice`` / ``simmemory`` re-export it).
"""

from tiercache.simdevice.device import Sim, simulated

__all__ = ["Sim", "simulated"]
