"""The CPU kernels of packed attention: a small C++ extension, built on first use.

    handles(codec, rows, which) -> bool     this kernel has the layout, and it is (or can be) built
    key_scores(q, codes, scale, offset, codec) -> [B, H, M, N*G]
    value_mix(p, codes, scale, offset, codec) -> [B, H, M, Dv]
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

NAME = "tiercache_packed_v1"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

template <int BITS>
static void keys_channel(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const torch::Tensor& q, torch::Tensor& out, int64_t G) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, D] float; q [B, H, M, D] float; out [B, H, M, N*G]
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), M = q.size(2), D = q.size(3);
  const int per = 8 / BITS, mask = (1 << BITS) - 1;
  const int64_t tp = G / per;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides();
  at::parallel_for(0, B * H * N, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> qs(M * D), c0(M), acc(M * per);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t n = idx % N, bh = idx / N, b = bh / H, h = bh % H;
      const uint8_t* row = cp + b * cs[0] + h * cs[1] + n * cs[2];
      const float* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
      const float* o = op + b * os[0] + h * os[1] + n * os[2];
      const float* qq = qp + bh * M * D;
      for (int64_t m = 0; m < M; ++m) {
        float z = 0.f;
        for (int64_t c = 0; c < D; ++c) {
          qs[m * D + c] = qq[m * D + c] * s[c];
          z += qq[m * D + c] * o[c];
        }
        c0[m] = z;
      }
      float* dst = outp + bh * M * N * G + n * G;
      for (int64_t t0 = 0; t0 < tp; ++t0) {
        const uint8_t* bytes = row + t0 * D;
        for (int i = 0; i < per; ++i) {
          const int shift = i * BITS;
          for (int64_t m = 0; m < M; ++m) {
            const float* w = qs.data() + m * D;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t c = 0; c < D; ++c) a += w[c] * (float)((bytes[c] >> shift) & mask);
            dst[m * N * G + i * tp + t0] = a + c0[m];
          }
        }
      }
    }
  });
}

template <int BITS>
static void values_token(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const torch::Tensor& p, torch::Tensor& out, int64_t G, int64_t ng, int64_t chunks) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, G*ng] float; p [B, H, M, N*G] float; out [B, H, C, M, Dv]
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), M = p.size(2), Dv = out.size(4);
  const int64_t gs = Dv / ng;
  const int per = 8 / BITS, mask = (1 << BITS) - 1;
  const int64_t tp = G / per;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides();
  const int64_t step = (N + chunks - 1) / chunks;
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> osum(M * ng);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t k = idx % chunks, bh = idx / chunks, b = bh / H, h = bh % H;
      float* acc = outp + idx * M * Dv;
      std::fill(acc, acc + M * Dv, 0.f);
      std::fill(osum.begin(), osum.end(), 0.f);
      const float* pr = pp + bh * M * N * G;
      for (int64_t n = k * step; n < std::min(N, (k + 1) * step); ++n) {
        const uint8_t* row = cp + b * cs[0] + h * cs[1] + n * cs[2];
        const float* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
        const float* o = op + b * os[0] + h * os[1] + n * os[2];
        for (int64_t t = 0; t < G; ++t) {
          const uint8_t* bytes = row + (t % tp) * Dv;
          const int shift = (int)(t / tp) * BITS;
          for (int64_t m = 0; m < M; ++m) {
            const float pm = pr[m * N * G + n * G + t];
            for (int64_t j = 0; j < ng; ++j) {
              const float ws = pm * s[t * ng + j];
              osum[m * ng + j] += pm * o[t * ng + j];
              float* a = acc + m * Dv + j * gs;
              const uint8_t* bj = bytes + j * gs;
#pragma omp simd
              for (int64_t c = 0; c < gs; ++c) a[c] += ws * (float)((bj[c] >> shift) & mask);
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

torch::Tensor key_scores(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor q,
                         int64_t bits, int64_t G) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), codes.size(2) * G}, q.options());
  if (bits == 2) keys_channel<2>(codes, scale, offset, q, out, G);
  else if (bits == 4) keys_channel<4>(codes, scale, offset, q, out, G);
  else keys_channel<8>(codes, scale, offset, q, out, G);
  return out;
}

torch::Tensor value_mix(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor p,
                        int64_t bits, int64_t G, int64_t ng, int64_t dv, int64_t chunks) {
  auto out = torch::empty({p.size(0), p.size(1), chunks, p.size(2), dv}, p.options());
  if (bits == 2) values_token<2>(codes, scale, offset, p, out, G, ng, chunks);
  else if (bits == 4) values_token<4>(codes, scale, offset, p, out, G, ng, chunks);
  else values_token<8>(codes, scale, offset, p, out, G, ng, chunks);
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


def key_scores(q, codes, scale, offset, codec) -> torch.Tensor:
    b, h, n, _ = codes.shape
    shape = (b, h, n, codec.d)
    return _STATE["module"].key_scores(codes, _meta(scale, shape), _meta(offset, shape), q.contiguous(),
                                       codec.backend.bits, codec.g)


def value_mix(p, codes, scale, offset, codec) -> torch.Tensor:
    b, h, n, _ = codes.shape
    ng = codec.shape[1]
    shape = (b, h, n, codec.g * ng)
    chunks = max(1, min(n, -(-2 * torch.get_num_threads() // (b * h))))
    return _STATE["module"].value_mix(codes, _meta(scale, shape), _meta(offset, shape), p.contiguous(),
                                      codec.backend.bits, codec.g, ng, codec.d, chunks)
