"""``Residual``: tokens of a quantized layer held exactly, in full precision, exactly sized.

    Residual()   keys / values ``[B, H, r, D]`` (or None); ``len``, ``view(lo, hi)``,
                 ``replace(drop, key, value)``, ``truncate(n)``, ``gather(index)``, ``clear()``,
                 ``nbytes()``, ``state_dict()`` / ``load_state_dict(sd, spec)``

``Quantize`` keeps two: the KIVI residual (the newest tokens, before they are packed) and the
attention sinks (the first tokens, never packed).
"""

from __future__ import annotations

import torch

from tiercache.layers.state import held_pair
from tiercache.layers.tiers import by_place


class Residual:
    """The newest tokens in full precision, in exactly-sized ``[B, H, r, D]`` tensors (or None)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def view(self, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if lo == 0 and hi is None:
            return self.keys, self.values
        hi = len(self) if hi is None else hi
        return self.keys.narrow(2, lo, hi - lo), self.values.narrow(2, lo, hi - lo)  # [B, H, hi-lo, D]

    def replace(self, drop: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Forget the oldest ``drop`` tokens and append ``key``/``value`` (copied), in one bounded copy."""
        held = len(self)
        if held - drop + key.shape[2] == 0:
            self.keys = self.values = None
        elif drop == held:
            self.keys, self.values = key.clone(memory_format=torch.contiguous_format), value.clone(
                memory_format=torch.contiguous_format)
        elif key.shape[2] or drop:
            k, v = self.view(drop)
            self.keys, self.values = torch.cat([k, key], 2), torch.cat([v, value], 2)

    def truncate(self, n: int) -> None:
        """Forget the newest ``n`` tokens."""
        if n:
            k, v = self.view(0, len(self) - n)
            self.keys, self.values = (k.clone(), v.clone()) if k.shape[2] else (None, None)

    def gather(self, index: torch.Tensor) -> None:
        if self.keys is not None:
            index = index.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def clear(self) -> None:
        self.keys = self.values = None

    def nbytes(self) -> dict[str, int]:
        if self.keys is None:
            return {}
        return by_place([self.keys, self.values])

    def state_dict(self) -> dict:
        return {"keys": self.keys, "values": self.values}

    def load_state_dict(self, sd: dict, spec) -> None:
        """Copy the state's tokens onto the compute device ``spec.device`` (checked first)."""
        k = sd.get("keys")
        if k is None and sd.get("values") is None:
            self.clear()
            return
        n = k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
        k, v = held_pair(sd, spec, n, "quantize (residual)")
        self.keys, self.values = (t.to(spec.device, copy=True, memory_format=torch.contiguous_format)
                                  for t in (k, v))
