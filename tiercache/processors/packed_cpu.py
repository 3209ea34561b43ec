"""The CPU kernels of packed attention: a small C++ extension, built on first use.

    handles(codec, rows, which) -> bool     this kernel has the layout, and it is (or can be) built
    key_scores(q, codes, scale, offset, codec, out, skip)    writes ``out`` ``[B, H, M, N*G - skip]``
    value_mix(p, codes, scale, offset, codec, skip) -> [B, H, M, Dv]   ``p`` ``[B, H, M, N*G - skip]``
    available() -> bool                     the extension is built (building it once if needed)

Layouts: integer codes of 2, 4 or 8 bits (planar, ``blocks.pack``), with an offset; keys per
channel (scale / offset ``[B, H, N, 1, D]``), values per token (``[B, H, N, G, n, 1]``), any
metadata dtype (the caller hands float32 scale / offset: views of the rows for float32 models,
a small conversion otherwise, ``meta_bits: 8`` rebuilt). Everything else goes to the torch
reference (``packed_attention``). Each packed byte is read once; no float copy of the codes is
written: the keys kernel forms ``(q * s) . code + q . o`` per block (OpenMP over blocks), the
values kernel ``sum_t (p_t s_t) code_t`` plus the offset sums (OpenMP over heads and runs of
blocks, partial sums added in torch).

Built with ``torch.utils.cpp_extension.load_inline`` (g++, ``-O3 -march=native -fopenmp``)
into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``):
about a minute once per machine, then a load. ``TIERCACHE_PACKED_KERNEL=torch`` turns it off;
a failed build is remembered (one warning) and the torch reference is used.
"""

from __future__ import annotations

import os
import warnings

import torch

NAME = "tiercache_packed_v3"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

template <int BITS>
static inline void unpack_block(const uint8_t* row, float* cf, int64_t G, int64_t D) {
  // planar codes of one block -> cf [G, D] floats (plane i: tokens [i*G/per, (i+1)*G/per))
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  const int64_t tp = G / per;
  for (int i = 0; i < per; ++i) {
    const int shift = i * BITS;
    float* dst = cf + i * tp * D;
#pragma omp simd
    for (int64_t e = 0; e < tp * D; ++e) dst[e] = (float)((row[e] >> shift) & mask);
  }
}

template <int BITS>
static void keys_channel(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const torch::Tensor& q, torch::Tensor& out, int64_t G, int64_t skip) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, D] float; q [B, H, M, D] float;
  // out [B, H, M, N*G - skip] float (any strides but the last): token n*G + t lands at n*G + t - skip
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), M = q.size(2), D = q.size(3);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides(), rs = out.strides();
  const int64_t grain = std::max<int64_t>(1, 65536 / (G * D));
  at::parallel_for(0, B * H * N, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> qs(M * D), cf(G * D);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t n = idx % N, bh = idx / N, b = bh / H, h = bh % H;
      const float* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
      const float* o = op + b * os[0] + h * os[1] + n * os[2];
      const float* qq = qp + bh * M * D;
      unpack_block<BITS>(cp + b * cs[0] + h * cs[1] + n * cs[2], cf.data(), G, D);
      float* dst = outp + b * rs[0] + h * rs[1] + n * G - skip;
      for (int64_t m = 0; m < M; ++m) {
        float z = 0.f;
        float* w = qs.data() + m * D;
        for (int64_t c = 0; c < D; ++c) {
          w[c] = qq[m * D + c] * s[c];
          z += qq[m * D + c] * o[c];
        }
        for (int64_t t = (n == 0 ? skip : 0); t < G; ++t) {
          const float* x = cf.data() + t * D;
          float a = 0.f;
#pragma omp simd reduction(+ : a)
          for (int64_t c = 0; c < D; ++c) a += w[c] * x[c];
          dst[m * rs[2] + t] = a + z;
        }
      }
    }
  });
}

template <int BITS>
static void values_token(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const torch::Tensor& p, torch::Tensor& out, int64_t G, int64_t ng, int64_t chunks,
                         int64_t skip) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, G*ng] float; out [B, H, C, M, Dv];
  // p [B, H, M, N*G - skip] float (any strides but the last): the weight of token n*G + t is at n*G + t - skip
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), M = p.size(2), Dv = out.size(4);
  const int64_t gs = Dv / ng;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides(), ps = p.strides();
  const int64_t step = (N + chunks - 1) / chunks;
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> osum(M * ng), cf(G * Dv);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t k = idx % chunks, bh = idx / chunks, b = bh / H, h = bh % H;
      float* acc = outp + idx * M * Dv;
      std::fill(acc, acc + M * Dv, 0.f);
      std::fill(osum.begin(), osum.end(), 0.f);
      const float* pr = pp + b * ps[0] + h * ps[1] - skip;
      for (int64_t n = k * step; n < std::min(N, (k + 1) * step); ++n) {
        const float* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
        const float* o = op + b * os[0] + h * os[1] + n * os[2];
        unpack_block<BITS>(cp + b * cs[0] + h * cs[1] + n * cs[2], cf.data(), G, Dv);
        for (int64_t m = 0; m < M; ++m) {
          const float* pm = pr + m * ps[2] + n * G;
          float* am = acc + m * Dv;
          for (int64_t t = (n == 0 ? skip : 0); t < G; ++t) {
            const float* x = cf.data() + t * Dv;
            for (int64_t j = 0; j < ng; ++j) {
              const float ws = pm[t] * s[t * ng + j];
              osum[m * ng + j] += pm[t] * o[t * ng + j];
              float* a = am + j * gs;
              const float* xj = x + j * gs;
#pragma omp simd
              for (int64_t c = 0; c < gs; ++c) a[c] += ws * xj[c];
            }
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < ng; ++j)
          for (int64_t c = 0; c < gs; ++c) acc[m * Dv + j * gs + c] += osum[m * ng + j];
    }
  });
}

void key_scores(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor q, torch::Tensor out,
                int64_t bits, int64_t G, int64_t skip) {
  if (bits == 2) keys_channel<2>(codes, scale, offset, q, out, G, skip);
  else if (bits == 4) keys_channel<4>(codes, scale, offset, q, out, G, skip);
  else keys_channel<8>(codes, scale, offset, q, out, G, skip);
}

torch::Tensor value_mix(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor p,
                        int64_t bits, int64_t G, int64_t ng, int64_t dv, int64_t chunks, int64_t skip) {
  auto out = torch::empty({p.size(0), p.size(1), chunks, p.size(2), dv}, p.options());
  if (bits == 2) values_token<2>(codes, scale, offset, p, out, G, ng, chunks, skip);
  else if (bits == 4) values_token<4>(codes, scale, offset, p, out, G, ng, chunks, skip);
  else values_token<8>(codes, scale, offset, p, out, G, ng, chunks, skip);
  return out.sum(2);
}
"""

_STATE: dict = {}


def available() -> bool:
    """The extension, built (once per machine) and loaded (once per process); False if it cannot be."""
    if "module" not in _STATE:
        _STATE["module"] = None
        if os.environ.get("TIERCACHE_PACKED_KERNEL", "") != "torch":
            try:
                from torch.utils.cpp_extension import load_inline

                _STATE["module"] = load_inline(NAME, cpp_sources=SOURCE, functions=["key_scores", "value_mix"],
                                               extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                               extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no ninja: the torch reference serves
                warnings.warn(f"tiercache: the packed-attention CPU kernel could not be built ({type(e).__name__}: "
                              f"{e}); using the pure-torch path", stacklevel=2)
    return _STATE["module"] is not None


def handles(codec, rows: torch.Tensor, which: str) -> bool:
    backend = codec.backend
    axis = "channel" if which == "keys" else "token"
    return (rows.device.type == "cpu" and backend.has_offset and backend.bits in (2, 4, 8)
            and codec.axis == axis and codec.g % (8 // backend.bits) == 0 and available())


def _meta(t: torch.Tensor, shape) -> torch.Tensor:
    t = t.reshape(shape)
    return t if t.stride(-1) == 1 else t.contiguous()


def key_scores(q, codes, scale, offset, codec, out: torch.Tensor, skip: int) -> None:
    """Writes ``out`` ``[B, H, M, N*G - skip]`` (a view with unit last stride is fine)."""
    b, h, n, _ = codes.shape
    shape = (b, h, n, codec.d)
    _STATE["module"].key_scores(codes, _meta(scale, shape), _meta(offset, shape), q.contiguous(), out,
                                codec.backend.bits, codec.g, skip)


def value_mix(p, codes, scale, offset, codec, skip: int) -> torch.Tensor:
    """``p`` ``[B, H, M, N*G - skip]`` (a view with unit last stride is fine) -> ``[B, H, M, Dv]``."""
    b, h, n, _ = codes.shape
    ng = codec.shape[1]
    shape = (b, h, n, codec.g * ng)
    chunks = max(1, min(n, -(-2 * torch.get_num_threads() // (b * h))))
    return _STATE["module"].value_mix(codes, _meta(scale, shape), _meta(offset, shape), p, codec.backend.bits,
                                      codec.g, ng, codec.d, chunks, skip)
