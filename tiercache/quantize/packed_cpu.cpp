
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t n) {
  // eight fixed lanes summed in a fixed order: the same bits wherever the data lies (a vectorizer's
  // reduction peels for alignment, so its sum order, and its last bit, would follow the addresses)
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[c + l] * b[c + l];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

template <int BITS>
static inline void unpack_block(const uint8_t* row, float* cf, int64_t G, int64_t D) {
  // planar codes of one block -> cf [G, D] floats (plane i: tokens [i*G/per, (i+1)*G/per))
  // centred: code - (2^bits - 1) / 2, the offset taking the rest (o + mid * s): the two terms of a score
  // or a value then do not cancel, which keeps float32 sums over long contexts as exact as the reference's
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  constexpr float mid = mask * 0.5f;
  const int64_t tp = G / per;
  for (int i = 0; i < per; ++i) {
    const int shift = i * BITS;
    float* dst = cf + i * tp * D;
#pragma omp simd
    for (int64_t e = 0; e < tp * D; ++e) dst[e] = (float)((row[e] >> shift) & mask) - mid;
  }
}

template <typename T>
static inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
static inline const float* as_float(const T* src, float* tmp, int64_t n) {
  // a row of n values as floats: the row itself for float32, else converted into tmp
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(src[i]);
    return tmp;
  }
}

// Runs f with T the C++ type of dtype t (float32, bfloat16 or float16): scales, offsets, exact K/V and the
// query are read in the model's dtype and converted in registers, so no float32 copy is made per step.
template <typename F>
static void with_type(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(at::BFloat16{});
  else if (t == at::kHalf) f(at::Half{});
  else TORCH_CHECK(false, "packed attention: tensors must be float32, bfloat16 or float16, got ", t);
}

template <int BITS, typename T>
static void keys_channel(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const float* qp, int64_t M, int64_t D, float* outp, const int64_t* rs, int64_t G,
                         int64_t skip) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, (1,) D] of T (unit stride inside a block); qp [B, H, M, D] float;
  // outp [B, H, M, N*G - skip] float with strides rs[0..2] (unit last): token n*G + t lands at n*G + t - skip
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const T* sp = static_cast<const T*>(scale.data_ptr());
  const T* op = static_cast<const T*>(offset.data_ptr());
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides();
  const int64_t grain = std::max<int64_t>(1, 262144 / (G * D * M));  // a parallel region only for real work
  constexpr float mid = ((1 << BITS) - 1) * 0.5f;
  at::parallel_for(0, B * H * N, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> qs(M * D), cf(G * D);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t n = idx % N, bh = idx / N, b = bh / H, h = bh % H;
      const T* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
      const T* o = op + b * os[0] + h * os[1] + n * os[2];
      const float* qq = qp + bh * M * D;
      unpack_block<BITS>(cp + b * cs[0] + h * cs[1] + n * cs[2], cf.data(), G, D);
      float* dst = outp + b * rs[0] + h * rs[1] + n * G - skip;
      for (int64_t m = 0; m < M; ++m) {
        float z = 0.f;
        float* w = qs.data() + m * D;
        for (int64_t c = 0; c < D; ++c) {
          const float sc = ld(s, c);
          w[c] = qq[m * D + c] * sc;
          z += qq[m * D + c] * (ld(o, c) + mid * sc);
        }
        for (int64_t t = (n == 0 ? skip : 0); t < G; ++t) {
          dst[m * rs[2] + t] = dot(w, cf.data() + t * D, D) + z;
        }
      }
    }
  });
}

template <int BITS, typename T>
static void values_token(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                         const float* pp, const int64_t* ps, int64_t M, float* outp, int64_t Dv, int64_t G,
                         int64_t ng, int64_t chunks, int64_t skip) {
  // codes [B, H, N, cb]; scale, offset [B, H, N, G, ng(, 1)] of T (unit stride inside a block); outp [B, H, C, M, Dv];
  // pp [B, H, M, N*G - skip] float with strides ps[0..2] (unit last): the weight of token n*G + t is at n*G + t - skip
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2);
  const int64_t gs = Dv / ng;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const T* sp = static_cast<const T*>(scale.data_ptr());
  const T* op = static_cast<const T*>(offset.data_ptr());
  const auto cs = codes.strides(), ss = scale.strides(), os = offset.strides();
  const int64_t step = (N + chunks - 1) / chunks;
  constexpr float mid = ((1 << BITS) - 1) * 0.5f;
  const int64_t grain = std::max<int64_t>(1, 262144 / (step * G * Dv * M));
  at::parallel_for(0, B * H * chunks, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> osum(M * ng), cf(G * Dv);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t k = idx % chunks, bh = idx / chunks, b = bh / H, h = bh % H;
      float* acc = outp + idx * M * Dv;
      std::fill(acc, acc + M * Dv, 0.f);
      std::fill(osum.begin(), osum.end(), 0.f);
      const float* pr = pp + b * ps[0] + h * ps[1] - skip;
      for (int64_t n = k * step; n < std::min(N, (k + 1) * step); ++n) {
        const T* s = sp + b * ss[0] + h * ss[1] + n * ss[2];
        const T* o = op + b * os[0] + h * os[1] + n * os[2];
        unpack_block<BITS>(cp + b * cs[0] + h * cs[1] + n * cs[2], cf.data(), G, Dv);
        for (int64_t m = 0; m < M; ++m) {
          const float* pm = pr + m * ps[2] + n * G;
          float* am = acc + m * Dv;
          for (int64_t t = (n == 0 ? skip : 0); t < G; ++t) {
            const float* x = cf.data() + t * Dv;
            for (int64_t j = 0; j < ng; ++j) {
              const float sc = ld(s, t * ng + j);
              const float ws = pm[t] * sc;
              osum[m * ng + j] += pm[t] * (ld(o, t * ng + j) + mid * sc);
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

template <typename T>
static void keys_bits(int64_t bits, const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& offset,
                      const float* qp, int64_t M, int64_t D, float* outp, const int64_t* rs, int64_t G, int64_t skip) {
  if (bits == 2) keys_channel<2, T>(codes, scale, offset, qp, M, D, outp, rs, G, skip);
  else if (bits == 4) keys_channel<4, T>(codes, scale, offset, qp, M, D, outp, rs, G, skip);
  else keys_channel<8, T>(codes, scale, offset, qp, M, D, outp, rs, G, skip);
}

template <typename T>
static void values_bits(int64_t bits, const torch::Tensor& codes, const torch::Tensor& scale,
                        const torch::Tensor& offset, const float* pp, const int64_t* ps, int64_t M, float* outp,
                        int64_t Dv, int64_t G, int64_t ng, int64_t chunks, int64_t skip) {
  if (bits == 2) values_token<2, T>(codes, scale, offset, pp, ps, M, outp, Dv, G, ng, chunks, skip);
  else if (bits == 4) values_token<4, T>(codes, scale, offset, pp, ps, M, outp, Dv, G, ng, chunks, skip);
  else values_token<8, T>(codes, scale, offset, pp, ps, M, outp, Dv, G, ng, chunks, skip);
}

static inline float exp_simd(float x) {
  // expf to about 1 ulp (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, scaled by 2^n by adding
  // n to the exponent bits) in plain arithmetic, so a loop over it vectorizes (glibc's expf does not);
  // -inf and anything below -87.3 give 0
  const float y = std::max(x, -87.3f);
  const float n = std::nearbyint(y * 1.44269504088896341f);
  const float r = (y - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += (int32_t)n << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return x < -87.3f ? 0.f : out;
}

static std::vector<float>& scratch(size_t n) {
  static thread_local std::vector<float> buf;  // reused: a fresh mapping per call page-faults more than it computes
  if (buf.size() < n) buf.resize(n);
  return buf;
}

static std::vector<float>& scratch2(size_t n) {  // a second one (the query, the values' partial sums)
  static thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

torch::Tensor attend(torch::Tensor query, double scale, torch::Tensor kc, torch::Tensor ks, torch::Tensor ko,
                     torch::Tensor vc, torch::Tensor vs, torch::Tensor vo, std::vector<torch::Tensor> ek,
                     std::vector<torch::Tensor> ev, int64_t at_blocks, int64_t skip, int64_t kbits, int64_t vbits,
                     int64_t G, int64_t ng, int64_t dv, int64_t chunks, c10::optional<torch::Tensor> mask) {
  // query [B, Hq, L, D] (float32 / bf16 / fp16, any strides), Hq = rep * H (query heads grouped onto the H K/V heads
  // as repeat_kv does: row m = r * L + l of head h is query head h * rep + r, token l), scaled by `scale` here;
  // packed keys / values as key_scores / value_mix take them (scales and offsets in their own dtype); exact
  // segments ek / ev [B, H, n_i, D] in the model dtype (unit last stride), the blocks between segment
  // at_blocks - 1 and at_blocks; mask [B, H, M, S] float contiguous (added) or none. Returns [B, Hq, L, dv] in the
  // query's dtype: one softmax over every column, one allocation, no other tensor op.
  const int64_t B = query.size(0), Hq = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t H = kc.size(1), N = kc.size(2), rep = Hq / H, M = rep * L;
  const int64_t nb = N * G - skip;
  std::vector<int64_t> start(ek.size());
  int64_t S = 0, bstart = 0;
  for (size_t i = 0; i <= ek.size(); ++i) {
    if ((int64_t)i == at_blocks) { bstart = S; S += nb; }
    if (i < ek.size()) { start[i] = S; S += ek[i].size(2); }
  }
  std::vector<float>& qbuf = scratch2(B * H * M * (D + chunks * dv));  // q [B, H, M, D], then parts [B, H, C, M, dv]
  float* qp = qbuf.data();
  float* pp = qp + B * H * M * D;
  const auto qs = query.strides();
  with_type(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(query.data_ptr());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int64_t l = 0; l < L; ++l) {
          float* dst = qp + ((b * H + hq / rep) * M + (hq % rep) * L + l) * D;
          const T* row = src + b * qs[0] + hq * qs[1] + l * qs[2];
          for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<float>(row[c * qs[3]]) * (float)scale;
        }
  });
  std::vector<float>& buf = scratch(B * H * M * S);
  float* bp = buf.data();
  const int64_t rows_strides[3] = {H * M * S, M * S, S};
  with_type(ks.scalar_type(), [&](auto tag) {
    keys_bits<decltype(tag)>(kbits, kc, ks, ko, qp, M, D, bp + bstart, rows_strides, G, skip);
  });
  const float* mp = mask.has_value() ? mask->data_ptr<float>() : nullptr;
  const int64_t rows_grain = std::max<int64_t>(1, 262144 / (M * S));  // few columns: no parallel region
  at::parallel_for(0, B * H, rows_grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(D);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (size_t i = 0; i < ek.size(); ++i) {
        const int64_t n = ek[i].size(2), st = ek[i].stride(2);
        with_type(ek[i].scalar_type(), [&](auto tag) {
          using T = decltype(tag);
          const T* kp = static_cast<const T*>(ek[i].data_ptr()) + b * ek[i].stride(0) + h * ek[i].stride(1);
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = as_float(kp + j * st, tmp.data(), D);
            for (int64_t m = 0; m < M; ++m) bp[(bh * M + m) * S + start[i] + j] = dot(qp + (bh * M + m) * D, kr, D);
          }
        });
      }
      for (int64_t m = 0; m < M; ++m) {  // the softmax, over every column at once
        float* row = bp + (bh * M + m) * S;
        if (mp) {
          const float* mr = mp + (bh * M + m) * S;
          for (int64_t j = 0; j < S; ++j) row[j] += mr[j];
        }
        float mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) mx = std::max(mx, row[j]);
#pragma omp simd
        for (int64_t j = 0; j < S; ++j) row[j] = exp_simd(row[j] - mx);
        float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // fixed order, as dot()
        int64_t j = 0;
        for (; j + 8 <= S; j += 8)
          for (int l = 0; l < 8; ++l) lanes[l] += row[j + l];
        float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        for (; j < S; ++j) sum += row[j];
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < S; ++j) row[j] *= inv;
      }
    }
  });
  with_type(vs.scalar_type(), [&](auto tag) {
    values_bits<decltype(tag)>(vbits, vc, vs, vo, bp + bstart, rows_strides, M, pp, dv, G, ng, chunks, skip);
  });
  auto out = torch::empty({B, Hq, L, dv}, query.options().memory_format(at::MemoryFormat::Contiguous));
  with_type(query.scalar_type(), [&](auto otag) {
    using O = decltype(otag);
    O* op = static_cast<O*>(out.data_ptr());  // [B, Hq, L, dv] contiguous is [B, H, M, dv]
    at::parallel_for(0, B * H, rows_grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> o(M * dv), tmp(dv);
      for (int64_t bh = lo; bh < hi; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        for (int64_t e = 0; e < M * dv; ++e) {
          float a = 0.f;
          for (int64_t k = 0; k < chunks; ++k) a += pp[(bh * chunks + k) * M * dv + e];
          o[e] = a;
        }
        for (size_t i = 0; i < ev.size(); ++i) {
          const int64_t n = ev[i].size(2), st = ev[i].stride(2);
          with_type(ev[i].scalar_type(), [&](auto tag) {
            using T = decltype(tag);
            const T* vp = static_cast<const T*>(ev[i].data_ptr()) + b * ev[i].stride(0) + h * ev[i].stride(1);
            for (int64_t j = 0; j < n; ++j) {
              const float* vv = as_float(vp + j * st, tmp.data(), dv);
              for (int64_t m = 0; m < M; ++m) {
                const float wj = bp[(bh * M + m) * S + start[i] + j];
                float* om = o.data() + m * dv;
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) om[c] += wj * vv[c];
              }
            }
          });
        }
        O* dst = op + bh * M * dv;
        for (int64_t e = 0; e < M * dv; ++e) dst[e] = static_cast<O>(o[e]);
      }
    });
  });
  return out;
}

void key_scores(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor q, torch::Tensor out,
                int64_t bits, int64_t G, int64_t skip) {
  // q [B, H, M, D] float contiguous; out [B, H, M, N*G - skip] float (unit last stride)
  const int64_t rs[3] = {out.stride(0), out.stride(1), out.stride(2)};
  with_type(scale.scalar_type(), [&](auto tag) {
    keys_bits<decltype(tag)>(bits, codes, scale, offset, q.data_ptr<float>(), q.size(2), q.size(3),
                             out.data_ptr<float>(), rs, G, skip);
  });
}

torch::Tensor value_mix(torch::Tensor codes, torch::Tensor scale, torch::Tensor offset, torch::Tensor p,
                        int64_t bits, int64_t G, int64_t ng, int64_t dv, int64_t chunks, int64_t skip) {
  auto out = torch::empty({p.size(0), p.size(1), chunks, p.size(2), dv}, p.options());
  const int64_t ps[3] = {p.stride(0), p.stride(1), p.stride(2)};
  with_type(scale.scalar_type(), [&](auto tag) {
    values_bits<decltype(tag)>(bits, codes, scale, offset, p.data_ptr<float>(), ps, p.size(2),
                               out.data_ptr<float>(), dv, G, ng, chunks, skip);
  });
  return out.sum(2);
}
