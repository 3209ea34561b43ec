"""The device runtime seam: streams, events, async copies, ``record_stream``, pinned host memory,
current device. Offload, prefetch, write-back and the non-finite check reach the device only
through it (never ``torch.cuda`` stream APIs directly).

Interface (``current()`` returns the runtime in use; ``installed(rt)`` swaps it for a block)
    device_of(t) -> home | None     the stream device a tensor lives on; None: no streams (the
                                    CPU): callers take their synchronous path
    home_of(device) -> home | None  the same for a ``torch.device`` (a layer loaded from a state)
    new_stream(home) -> Stream      a side stream on that device
    current_stream(home) -> Stream  the compute stream there (what kernels run on now)
    use(stream)                     context: the enclosed ops (copies) run on ``stream``
    event() -> Event                ``record(stream)``, ``query()``, ``synchronize()``
    record_stream(t, stream)        ``t``'s memory is not reused before ``stream``'s work so far
    pinned_empty(shape, dtype)      page-locked host memory (staging for async copies)
    host_empty(shape, dtype, pin)   host memory for a host tier, pinned when ``pin`` and possible
    can_pin() -> bool               whether pinned host memory exists here
    device_empty(nbytes, home)      ``[nbytes]`` uint8 device memory, allocated on the compute stream
    current_device() -> int         the index ``torch.device("cuda")`` means
``device_key(device)`` names a device for a cache of per-device tensors (simulated devices
all say "cpu"). ``canonical_device(device)`` is the one form a device is stored and compared in:
``cuda`` -> ``cuda:<current index>`` (what a tensor made there reports), ``cpu:N`` -> ``cpu``. A ``Stream`` has ``wait_event(e)``, ``wait_stream(s)``, ``synchronize()``. Async copies are
``dst.copy_(src, non_blocking=True)`` inside ``use(stream)`` (or on the compute stream).

Two implementations: ``CudaRuntime`` (here; the torch.cuda objects themselves) and the
simulated device (``tiercache.simdevice``), deterministic, for the CPU tests: there
a copy lands only when its stream is advanced past it, so every ordering call is exercised.
"""

from __future__ import annotations

import contextlib

import torch


class CudaRuntime:
    name = "cuda"

    def device_of(self, t: torch.Tensor):
        if not t.is_cuda:
            return None
        return t.device if t.device.index is not None else torch.device("cuda", self.current_device())

    def home_of(self, device):
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return device if device.index is not None else torch.device("cuda", self.current_device())

    def new_stream(self, home):
        return torch.cuda.Stream(home)

    def current_stream(self, home):
        return torch.cuda.current_stream(home)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def record_stream(self, t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def host_empty(self, shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and self.can_pin())

    def can_pin(self) -> bool:
        return torch.cuda.is_available()

    def device_empty(self, nbytes: int, home) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=home)

    def current_device(self) -> int:
        return torch.cuda.current_device()


CUDA = CudaRuntime()
_installed = []


def canonical_device(device) -> torch.device:
    """``device`` as a tensor allocated there reports it, so that stored and incoming devices compare
    equal: ``cuda`` (no index) names the current CUDA device (``cuda:0`` ...), ``cpu:0`` is ``cpu``.
    Without CUDA, ``cuda`` stays as it is (whoever allocates there raises the clear error)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        try:
            return torch.device("cuda", current().current_device())
        except (AssertionError, RuntimeError):  # torch without CUDA, or no device present
            return device
    return device


def device_key(device) -> tuple:
    """A key naming ``device`` for caches of per-device tensors (simulated devices apart)."""
    home = current().home_of(device)
    return canonical_device(device), getattr(home, "index", None)  # an index: a cache never keeps a runtime alive


def current():
    """The runtime in use: the innermost ``installed`` one, else CUDA's."""
    return _installed[-1] if _installed else CUDA


@contextlib.contextmanager
def installed(rt):
    """Use ``rt`` (a simulated device) for the enclosed block."""
    _installed.append(rt)
    try:
        yield rt
    finally:
        _installed.remove(rt)
