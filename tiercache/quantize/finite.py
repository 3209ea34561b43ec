"""``FiniteGuard``: a quantized layer refuses non-finite keys/values, without a host sync on CUDA.

Interface (used by ``Quantize``)
    guard.check(key, value, seen, describe)   before an update changes anything
    guard.surface()                           raise for a flag that has landed (each use calls it)
    guard.settle()                            wait for every flag, then ``surface()`` (lifecycle)
    guard.crop_to(seen), guard.reset()        follow the layer's crops and resets
    guard.pending()                           flags not yet read (tests)
    describe(key, value, seen, group) -> str  where the first non-finite value of an update is
    refuse_non_finite(key, value, describe)   the synchronous check (CPU updates, bulk ingest)

One NaN would poison the scale of a whole quantization group, so the layer refuses them.
Streams, events and pinned memory come from the device runtime (``tiercache.runtime``:
CUDA, or the simulated device of the CPU tests).
- CPU (and any device without streams): ``max |x|`` over the new tokens is read at once (NaN and
  inf propagate); a bad update raises ``CacheError`` (``describe()`` says where) and changes
  nothing, as before.
- CUDA: reading the flag would stall the host once per layer per token, so ``max |x|`` itself
  is copied to pinned host memory on the compute stream (non_blocking) with an event, and read
  when it has landed (``event.query()``, never a wait): at the latest at the layer's next use
  (``update`` / ``kv``). Four device ops per update (two max-abs, their maximum, the copy) and
  no allocation: the pinned slots are the guard's own, reused once read (``SLOTS`` of them; more
  in flight at once get fresh ones). Then the layer raises ``CacheError`` naming the positions of the
  earlier update and stays refused ("poisoned") until it is reset or cropped back to before
  them: that update had already been stored, and only dropping it makes the layer right again.

Lifecycle. The guard's state is not saved: ``state_dict`` / ``export`` / ``adopt`` (so fork,
retier and save) first ``settle()`` the guard (a wait for the flags still in flight, then the
same ``CacheError`` the next use would raise), so a poisoned layer is never saved, forked or
moved silently; a loaded, ingested or adopting layer starts with a clean guard.
"""

from __future__ import annotations

import math

import torch

from tiercache import runtime
from tiercache.errors import CacheError


def _worst(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over keys and values (NaN and inf propagate), a 0-dim tensor on their device."""
    return torch.maximum(torch.linalg.vector_norm(key, math.inf), torch.linalg.vector_norm(value, math.inf))


def refuse_non_finite(key: torch.Tensor, value: torch.Tensor, describe) -> None:
    """``CacheError(describe())`` when ``key`` or ``value`` holds a NaN or inf (one host read)."""
    if key.shape[2] and not math.isfinite(float(_worst(key, value))):
        raise CacheError(describe())


SLOTS = 64  # pinned slots (the keys' dtype) a guard reuses for its flags (more in flight: fresh ones)


class FiniteGuard:
    def __init__(self):
        self.flags: list[tuple[int, int, torch.Tensor, object]] = []  # (position, tokens, pinned max |x|, event)
        self.bad_at: int | None = None  # first position of a refused (already stored) update
        self._slots: torch.Tensor | None = None  # [SLOTS] pinned, the keys' dtype, made at the first deferred check
        self._free: list[int] = []  # slots not holding an unread flag

    def _slot(self, rt, dtype: torch.dtype) -> torch.Tensor:
        """A pinned scalar of ``dtype`` for one flag: a free slot of the guard's own, else a fresh one."""
        if self._slots is None or self._slots.dtype != dtype:
            if self._slots is not None and len(self._free) < SLOTS:  # flags of another dtype still unread
                return rt.pinned_empty((), dtype)
            self._slots = rt.pinned_empty((SLOTS,), dtype)
            self._free = list(range(SLOTS))
        if self._free:
            return self._slots[self._free.pop()]
        return rt.pinned_empty((), dtype)

    def _release(self, flag: torch.Tensor) -> None:
        """``flag`` was read (or dropped): its slot, if it is one, may hold the next flag."""
        if self._slots is not None and flag.untyped_storage().data_ptr() == self._slots.untyped_storage().data_ptr():
            self._free.append(flag.storage_offset() - self._slots.storage_offset())

    def check(self, key: torch.Tensor, value: torch.Tensor, seen: int, describe) -> None:
        self.surface()
        if not key.shape[2]:
            return
        rt = runtime.current()
        home = rt.device_of(key)
        if home is None:  # no streams (the CPU): read at once
            refuse_non_finite(key, value, describe)
            return
        worst = _worst(key, value)
        flag = self._slot(rt, worst.dtype)
        flag.copy_(worst, non_blocking=True)  # NaN / inf propagate: read as "not finite" on the host
        done = rt.event()
        done.record(rt.current_stream(home))
        self.flags.append((seen, key.shape[2], flag, done))

    def surface(self) -> None:
        if self.bad_at is None:
            waiting = []
            for i, (at, t, flag, done) in enumerate(self.flags):
                if not done.query():  # not landed yet: read at a later use
                    waiting.append((at, t, flag, done))
                    continue
                bad = _flagged(flag)
                self._release(flag)
                if bad:
                    for _, _, other, _ in (*waiting, *self.flags[i + 1:]):  # dropped unread
                        self._release(other)
                    self.bad_at, self.flags = at, []
                    raise CacheError(
                        f"non-finite values in the keys/values of an earlier update (positions {at}..{at + t - 1}); "
                        "quantized caches refuse them because one NaN would corrupt a whole group; the layer "
                        f"refuses further use until reset() or crop() back to {at} tokens")
            self.flags = waiting
        if self.bad_at is not None:
            raise CacheError(f"this quantized layer holds non-finite values from position {self.bad_at}; "
                             f"reset() it or crop() it back to {self.bad_at} tokens")

    def settle(self) -> None:
        for _, _, _, done in self.flags:
            done.synchronize()
        self.surface()

    def crop_to(self, seen: int) -> None:
        for f in self.flags:
            if f[0] >= seen:
                self._release(f[2])
        self.flags = [f for f in self.flags if f[0] < seen]
        if self.bad_at is not None and seen <= self.bad_at:
            self.bad_at = None

    def reset(self) -> None:
        for f in self.flags:
            self._release(f[2])
        self.flags, self.bad_at = [], None

    def pending(self) -> int:
        return len(self.flags)


def _flagged(flag: torch.Tensor) -> bool:
    """A landed flag says "not finite": ``max |x|`` read as a float (a bool flag: as such)."""
    if flag.dtype == torch.bool:
        return bool(flag)
    return not math.isfinite(float(flag))


def describe(key: torch.Tensor, value: torch.Tensor, seen: int, group: int) -> str:
    """The refusal of an update (its first token at position ``seen``): where, and why."""
    where = "an unknown place"
    for name, t in (("keys", key), ("values", value)):
        bad = (~torch.isfinite(t)).nonzero()
        if len(bad):
            b, h, tok, d = (int(x) for x in bad[0])
            where = (f"{name}[batch {b}, head {h}, token {tok} of this update (position {seen + tok}), "
                     f"dim {d}] ({len(bad)} non-finite of this update's {t.numel()} {name} elements)")
            break
    return (f"non-finite values in keys/values at {where}; quantized caches refuse them because one NaN "
            f"would corrupt a whole group of {group} tokens; use a full-precision policy to keep them")
