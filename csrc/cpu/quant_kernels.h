// The inner loops of the quantized kernels (quant.cpp), written once over a vector type V and
// included once per x86 level inside a `#pragma GCC target` region, so each build's instructions
// come from the same source: the AVX2 build (tested on any AVX2 machine) and the AVX-512 build
// differ only in V's few primitives (quant.cpp). No include guard: it is meant to be included
// more than once, each time in its own namespace with its own V.
//
// V provides: reg (L floats), ireg (L int32), L, zero(), load(const float*), set1(float),
// fma(a, b, c) = a * b + c, fnma(a, b, c) = c - a * b, add, mul, hsum(reg), u8(const uint8_t*) and
// i8(const uint8_t*) (L bytes zero- / sign-extended to int32), and_15(ireg), srl4(ireg),
// to_float(ireg), store(float*, reg).

// Chains used in turn: after n of the U were used, the next n come first (a no-op where n is a
// multiple of U). Register renames once the loops are unrolled.
template <int U, int n = 1>
inline void rotate(typename V::reg (&a)[U]) {
  if constexpr (n % U != 0) {
    typename V::reg b[U];
    for (int i = 0; i < U; ++i) b[i] = a[(i + n) % U];
    for (int i = 0; i < U; ++i) a[i] = b[i];
  }
}

// The sum of n floats (n a multiple of V::L).
inline float sum_f32(const float* a, int64_t n) {
  typename V::reg t = V::zero();
  for (int64_t i = 0; i < n; i += V::L) t = V::add(t, V::load(a + i));
  return V::hsum(t);
}

// A scale as float: float32 as stored, bfloat16 as its upper 16 bits.
template <typename S>
inline float scale_at(const S* s, int64_t i) {
  if constexpr (std::is_same_v<S, float>) {
    return s[i];
  } else {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

// The channel's G scales as float32 into sf: float32 ones are copied, bfloat16 ones widened (their
// bits shifted up), so the group loops broadcast each from memory.
template <typename S>
inline void scales_f32(const S* s, int64_t G, float* sf) {
  if constexpr (std::is_same_v<S, float>) {
    std::memcpy(sf, s, G * sizeof(float));
  } else {
    int64_t g = 0;
    for (; g + V::L <= G; g += V::L) V::store(sf + g, V::bf16(s + g));
    for (; g < G; ++g) sf[g] = scale_at(s, g);
  }
}

// sum_g a[g] * b[g] over n values.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  typename V::reg t = V::zero();
  int64_t i = 0;
  for (; i + V::L <= n; i += V::L) t = V::fma(V::load(a + i), V::load(b + i), t);
  float sum = V::hsum(t);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// work: G + R * G floats of the caller's scratch (the channel's scales, and for int4 each row's
// group sums).
// y[r * ldy + c] = sum_i x[r * K + i] * value(c, i) * s[c * G + i / gs] for the channels c < nch
// (channel c's bytes at q + c * q_row): int8 values, K inputs, G = K / gs groups (gs = K for one
// scale per channel, where K need not be a multiple of 32; with groups K is the stored inputs,
// padded to whole groups). Within a group each row keeps U chains
// of products (the blocks' vectors in turn), enough independent FMAs to hide their latency with
// groups of 32 or more; each group's sum is scaled into A accumulators in turn.
template <int R, int U, typename S>
void qdot8(const float* x, float* work, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K, int64_t gs,
           int64_t nch, float* y, int64_t ldy) {
  using reg = typename V::reg;
  constexpr int L = V::L, A = R <= 2 ? 2 : 1;
  float* sf = work;
  for (int64_t c = 0; c < nch; ++c) {
    const uint8_t* qc = q + c * q_row;
    scales_f32(s + c * G, G, sf);
    reg acc[R][A];
    float tail[R] = {};
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t g1 = (g + 1) * gs;
      reg part[R][U];
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) part[r][u] = V::zero();
      int64_t i = g * gs;
      for (; i + 32 <= g1; i += 32) {
        for (int v = 0; v < 32 / L; ++v) {
          const reg w = V::to_float(V::i8(qc + i + v * L));
          for (int r = 0; r < R; ++r) part[r][v % U] = V::fma(V::load(x + r * K + i + v * L), w, part[r][v % U]);
        }
        for (int r = 0; r < R; ++r) rotate<U, 32 / L>(part[r]);
      }
      for (; i < g1; ++i) {  // one scale per channel: the inputs past the last block
        const float w = static_cast<float>(static_cast<int8_t>(qc[i]));
        for (int r = 0; r < R; ++r) tail[r] += x[r * K + i] * w;
      }
      const reg sc = V::set1(sf[g]);
      for (int r = 0; r < R; ++r) {
        reg t = part[r][0];
        for (int u = 1; u < U; ++u) t = V::add(t, part[r][u]);
        acc[r][0] = V::fma(t, sc, acc[r][0]);
        rotate(acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      reg t = acc[r][0];
      for (int a = 1; a < A; ++a) t = V::add(t, acc[r][a]);
      y[r * ldy + c] = V::hsum(t) + tail[r] * sf[0];  // a tail only where G == 1
    }
  }
}

// qdot8 for int4 (gs a multiple of 32): each 16-byte block's bytes zero-extended to 32-bit lanes,
// the low nibble (input j) and the high one (input j + 16) taken from each and multiplied as
// stored (value + 8); the 8s come off once a channel, as 8 * sum_g scale_g * (row's sum over g).
template <int R, int U, typename S>
void qdot4(const float* x, float* work, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K, int64_t gs,
           int64_t nch, float* y, int64_t ldy) {
  using reg = typename V::reg;
  constexpr int L = V::L, A = R <= 2 ? 2 : 1;
  float *sf = work, *xs = work + G;
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) xs[r * G + g] = sum_f32(x + r * K + g * gs, gs);
  for (int64_t c = 0; c < nch; ++c) {
    const uint8_t* qc = q + c * q_row;
    scales_f32(s + c * G, G, sf);
    reg acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
    const uint8_t* qb = qc;
    for (int64_t g = 0; g < G; ++g) {
      reg part[R][U];
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) part[r][u] = V::zero();
      for (int64_t i = g * gs; i < (g + 1) * gs; i += 32, qb += 16) {
        for (int v = 0; v < 16 / L; ++v) {
          const auto d = V::u8(qb + v * L);
          const reg lo = V::to_float(V::and_15(d)), hi = V::to_float(V::srl4(d));
          for (int r = 0; r < R; ++r) {
            const float* xr = x + r * K + i + v * L;
            part[r][(2 * v) % U] = V::fma(V::load(xr), lo, part[r][(2 * v) % U]);
            part[r][(2 * v + 1) % U] = V::fma(V::load(xr + 16), hi, part[r][(2 * v + 1) % U]);
          }
        }
        for (int r = 0; r < R; ++r) rotate<U, 2 * 16 / L>(part[r]);
      }
      const reg sc = V::set1(sf[g]);
      for (int r = 0; r < R; ++r) {
        reg t = part[r][0];
        for (int u = 1; u < U; ++u) t = V::add(t, part[r][u]);
        acc[r][0] = V::fma(t, sc, acc[r][0]);
        rotate(acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      reg t = acc[r][0];
      for (int a = 1; a < A; ++a) t = V::add(t, acc[r][a]);
      y[r * ldy + c] = V::hsum(t) - 8.0f * dot_f32(sf, xs + r * G, G);
    }
  }
}

// One channel's float weights: out[i] = value_i * s[i / gs] (int8, or int4 with gs a multiple of
// 32), for the prefill's tile.
template <int bits, typename S>
void dequant(const uint8_t* q, const S* s, int64_t K, int64_t gs, float* out) {
  using reg = typename V::reg;
  constexpr int L = V::L;
  const reg minus8 = V::set1(-8.0f);
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, ++g) {
    const int64_t g1 = std::min(K, g0 + gs);
    const float sf = scale_at(s, g);
    const reg sc = V::set1(sf);
    int64_t i = g0;
    for (; i + 32 <= g1; i += 32) {
      if constexpr (bits == 8) {
        for (int v = 0; v < 32 / L; ++v) V::store(out + i + v * L, V::mul(V::to_float(V::i8(q + i + v * L)), sc));
      } else {
        for (int v = 0; v < 16 / L; ++v) {
          const auto d = V::u8(q + i / 2 + v * L);
          V::store(out + i + v * L, V::mul(V::add(V::to_float(V::and_15(d)), minus8), sc));
          V::store(out + i + 16 + v * L, V::mul(V::add(V::to_float(V::srl4(d)), minus8), sc));
        }
      }
    }
    for (; i < g1; ++i) out[i] = static_cast<float>(static_cast<int8_t>(q[i])) * sf;
  }
}
