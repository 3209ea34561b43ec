"""Tiers: where a layer's tensors are allocated, and how that place is named in ``nbytes()``.

Interface (tiny on purpose)
    empty(shape, dtype, device) -> Tensor   a new uninitialised tensor on this tier; ``device``
                                             is the compute device, used by tiers that follow it
    place(device) -> str                     the key under which its bytes are reported
    kind                                     the tier it is: ``device``, ``host`` or ``disk``
                                             (``tier_nbytes()`` keys, apart even on a CPU-only run)
    free(tensor)                             the tier may release what backs ``tensor`` (files)
    close()                                  release everything for good

Accounting helpers: ``place_of(device)``, ``nbytes_of(*tensors)``, ``summed(dicts)``, ``by_place(tensors)``.

``ComputeTier`` allocates beside the model (its device comes from the first update).
``HostTier`` keeps tensors in CPU memory, pinned when the device runtime
(``tiercache.runtime``: CUDA, or the simulated device) has pinned memory and it is asked for.
The disk tier lives with the offload processor (``tiercache.offload.disk``). Every tier charges
an allocation to ``tiercache.layers.allowance`` before making it (a bounded ``load``).
"""

from __future__ import annotations

import torch

from tiercache import runtime
from tiercache.layers import allowance


def place_of(device: torch.device | str) -> str:
    """A stable name for a device: ``cpu``, ``cuda:0`` ..."""
    return str(runtime.canonical_device(device))


def nbytes_of(*tensors: torch.Tensor) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def summed(parts) -> dict[str, int]:
    """Dicts of bytes added key by key."""
    total: dict[str, int] = {}
    for part in parts:
        for key, n in part.items():
            total[key] = total.get(key, 0) + n
    return total


def by_place(tensors) -> dict[str, int]:
    """Bytes of tensors by where they lie (``place_of``)."""
    return summed({place_of(t.device): nbytes_of(t)} for t in tensors)


class ComputeTier:
    """Allocates on the compute device (the device the keys arrive on)."""

    kind = "device"

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        allowance.charge(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def place(self, device: torch.device) -> str:
        return place_of(device)

    def free(self, tensor: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass


class HostTier:
    """Allocates in CPU memory; pinned (page-locked) when CUDA is available and ``pin`` is set."""

    kind = "host"

    def __init__(self, pin: bool = True):
        self.pin = bool(pin) and runtime.current().can_pin()

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        allowance.charge(shape, dtype)
        return runtime.current().host_empty(shape, dtype, self.pin)  # pinned memory: the device runtime's

    def place(self, device: torch.device) -> str:
        return "cpu"

    def free(self, tensor: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass
