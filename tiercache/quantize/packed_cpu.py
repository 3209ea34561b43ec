"""The CPU kernels of packed attention: a small C++ extension, built ahead of use.

    handles(codec, rows, which) -> bool     this kernel has the layout, and it is built
    attend(query, scale, keys, values, exact, at_blocks, skip, mask) -> [B, Hq, L, Dv]
                                            a decode step's whole attention, one call
    key_scores(q, codes, scale, offset, codec, out, skip)    writes ``out`` ``[B, H, M, N*G - skip]``
    value_mix(p, codes, scale, offset, codec, skip) -> [B, H, M, Dv]   ``p`` ``[B, H, M, N*G - skip]``
    available() -> bool                     the extension is built and loaded (once per process)
    kernel() -> kernel_build.Kernel         what ``tiercache build-kernels`` compiles
    source() -> str                         its C++ text (``packed_cpu.cpp``, package data)

Layouts: integer codes of 2, 4 or 8 bits (planar, ``blocks.pack``), with an offset; keys per
channel (scale / offset ``[B, H, N, 1, D]``), values per token (``[B, H, N, G, n, 1]``), a
float32, bfloat16 or float16 model. Scales and offsets are read where they lie (views of the
rows, in the model's dtype; ``meta_bits: 8`` rebuilt first), the exact K/V and the query in their
own dtype, each converted to float32 in registers: a decode step makes no float32 copy of
anything, and ``attend`` allocates only its output (the fewer ops a step issues, the less it
costs beyond the arithmetic). Everything else goes to the torch reference (``packed_attention``).
Each packed byte is read once; no float copy of the codes is written: the keys kernel forms
``(q * s) . code + q . o`` per block (OpenMP over blocks), the values kernel ``sum_t (p_t s_t)
code_t`` plus the offset sums (OpenMP over heads and runs of blocks).

Built by ``tiercache build-kernels`` (``make`` runs it; ``tiercache.quantize.kernel_build``) with
``torch.utils.cpp_extension.load_inline`` (g++, ``-O3 -march=native -fopenmp``): about a minute,
once per torch install and CPU, never inside a run. A run only loads that build; where there is
none it warns once and uses the torch reference (``TIERCACHE_KERNEL_BUILD=lazy`` builds it at
first use instead). ``TIERCACHE_PACKED_KERNEL=torch`` turns it off.
"""

from __future__ import annotations

import os
from importlib import resources

import torch

from tiercache.quantize import kernel_build

NAME = "tiercache_packed_v10"
SOURCE_FILE = "packed_cpu.cpp"

_STATE: dict = {}


def source() -> str:
    """The extension's C++ text: ``packed_cpu.cpp``, shipped beside this module as package data (the
    keys and values kernels and ``attend``, templated on the model's dtype)."""
    return resources.files(__package__).joinpath(SOURCE_FILE).read_text(encoding="utf-8")


def kernel() -> kernel_build.Kernel:
    """The extension's source and flags (``kernel_build`` keys its build by them: an edit of
    ``packed_cpu.cpp`` is a new build)."""
    return kernel_build.Kernel(NAME, source(), ("key_scores", "value_mix", "attend"),
                               cflags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=off"), ldflags=("-fopenmp",))


def available() -> bool:
    """The extension, built ahead (``tiercache build-kernels``) and loaded once per process; False
    (with one warning naming the build step) where it is not built."""
    if "module" not in _STATE:
        _STATE["module"] = None
        if os.environ.get("TIERCACHE_PACKED_KERNEL", "") != "torch":
            _STATE["module"] = kernel_build.load(kernel())
    return _STATE["module"] is not None


def handles(codec, rows: torch.Tensor, which: str) -> bool:
    backend = codec.backend
    axis = "channel" if which == "keys" else "token"
    return (rows.device.type == "cpu" and backend.has_offset and backend.bits in (2, 4, 8)
            and codec.axis == axis and codec.g % (8 // backend.bits) == 0 and codec.dtype in _DTYPES and available())


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads scales, offsets and K/V in


def _chunks(b: int, h: int, n: int, g: int) -> int:
    """Runs of blocks per head the values kernel splits into: one unless the context is long
    enough (16k tokens x heads a run) for threads to pay for their start and join."""
    threads = torch.get_num_threads()
    if threads == 1 or b * h * n * g < 16384 * 2:
        return 1
    return max(1, min(n, -(-2 * threads // (b * h)), b * h * n * g // 16384))


def key_scores(q, codes, scale, offset, codec, out: torch.Tensor, skip: int) -> None:
    """Writes ``out`` ``[B, H, M, N*G - skip]`` (a view with unit last stride is fine); ``q``
    ``[B, H, M, D]`` float32; ``scale`` / ``offset`` ``[B, H, N, 1, D]`` in the model's dtype or float32
    (``packed_attention.raw_parts``: views of the rows)."""
    _STATE["module"].key_scores(codes, scale, offset, q.contiguous(), out, codec.backend.bits, codec.g, skip)


def value_mix(p, codes, scale, offset, codec, skip: int) -> torch.Tensor:
    """``p`` ``[B, H, M, N*G - skip]`` float32 (a view with unit last stride is fine) -> ``[B, H, M, Dv]``;
    ``scale`` / ``offset`` ``[B, H, N, G, n, 1]`` as ``key_scores`` takes them."""
    b, h, n, _ = codes.shape
    chunks = _chunks(b, h, n, codec.g)
    return _STATE["module"].value_mix(codes, scale, offset, p, codec.backend.bits, codec.g, codec.shape[1], codec.d,
                                      chunks, skip)


def attend(query, scale: float, keys, values, exact, at_blocks: int, skip: int, mask) -> torch.Tensor:
    """The whole decode attention in one call (one allocation, the output): ``query`` ``[B, Hq, L, D]``
    in the model's dtype (``Hq`` a multiple of the K/V heads, grouped as ``repeat_kv`` does), scaled by
    ``scale`` inside; ``keys`` / ``values`` ``(codes, scale, offset, codec)`` of the packed blocks
    (``packed_attention.raw_parts``: the rows' own views, no float32 copy); ``exact`` the exact
    segments ``[(k, v)]`` ``[B, H, r, D]`` in the model's dtype (unit last stride) in token order with
    the blocks before ``exact[at_blocks]``; ``mask`` None or float32 ``[B, H, M, S]`` (``M = Hq / H * L``).
    Returns ``[B, Hq, L, Dv]`` in the query's dtype."""
    (kc, ks, ko, kcodec), (vc, vs, vo, vcodec) = keys, values
    b, h, n, _ = kc.shape
    chunks = _chunks(b, h, n, kcodec.g)
    return _STATE["module"].attend(query, scale, kc, ks, ko, vc, vs, vo, [k for k, _ in exact], [v for _, v in exact],
                                   at_blocks, skip, kcodec.backend.bits, vcodec.backend.bits, kcodec.g,
                                   vcodec.shape[1], vcodec.d, chunks, mask)
