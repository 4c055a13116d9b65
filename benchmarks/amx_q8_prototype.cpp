// The AMX prototype of benchmarks/amx_q8_prototype.py (research; see its docstring).
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct Cfg { uint8_t palette, start; uint8_t r0[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg() {
    Cfg c{}; c.palette = 1;
  for (int t = 0; t < 2; ++t) { c.rows[t] = 16; c.colsb[t] = 32; }   // A: 16 rows x 32 int8
  for (int t = 2; t < 4; ++t) { c.rows[t] = 8; c.colsb[t] = 64; }    // B: 8 quads x 16 cols x 4
  for (int t = 4; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }   // C: 16 x 16 int32
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
// xq (M, Kq) int8, d (M, B) f32, wp (N/16, B, 8, 64) int8, ws (N/16, B, 16) f32 -> y (M, N) f32
torch::Tensor q8b_amx(torch::Tensor xq, torch::Tensor d, torch::Tensor wp, torch::Tensor ws) {
  const int64_t M = xq.size(0), Kq = xq.size(1), B = Kq / 32, N = wp.size(0) * 16;
  auto y = torch::empty({M, N}, d.options());
  const int8_t* X = xq.data_ptr<int8_t>(); const float* D = d.data_ptr<float>();
  const int8_t* W = wp.data_ptr<int8_t>(); const float* S = ws.data_ptr<float>(); float* Y = y.data_ptr<float>();
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int64_t mt = M / 32, nt = N / 32;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t i = 0; i < mt; ++i) for (int64_t j = 0; j < nt; ++j) {
    cfg();
    alignas(64) int32_t buf[4][16][16]; alignas(64) float acc[32][32];
    for (int r = 0; r < 32; ++r) for (int c = 0; c < 32; ++c) acc[r][c] = 0.f;
    const int8_t* x0 = X + (32 * i) * Kq; const int8_t* x1 = x0 + 16 * Kq;
    for (int64_t b = 0; b < B; ++b) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      _tile_loadd(0, x0 + 32 * b, Kq); _tile_loadd(1, x1 + 32 * b, Kq);
      _tile_loadd(2, W + ((2 * j) * B + b) * 512, 64); _tile_loadd(3, W + ((2 * j + 1) * B + b) * 512, 64);
      _tile_dpbssd(4, 0, 2); _tile_dpbssd(5, 0, 3); _tile_dpbssd(6, 1, 2); _tile_dpbssd(7, 1, 3);
      _tile_stored(4, buf[0], 64); _tile_stored(5, buf[1], 64); _tile_stored(6, buf[2], 64); _tile_stored(7, buf[3], 64);
      const __m512 w0 = _mm512_loadu_ps(S + ((2 * j) * B + b) * 16), w1 = _mm512_loadu_ps(S + ((2 * j + 1) * B + b) * 16);
      for (int h = 0; h < 2; ++h) for (int r = 0; r < 16; ++r) {
        const int row = 16 * h + r;
        const __m512 dv = _mm512_set1_ps(D[(32 * i + row) * B + b]);
        float* a = acc[row];
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[2 * h][r])), _mm512_mul_ps(dv, w0), _mm512_load_ps(a)));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[2 * h + 1][r])), _mm512_mul_ps(dv, w1), _mm512_load_ps(a + 16)));
      }
    }
    for (int r = 0; r < 32; ++r) memcpy(Y + (32 * i + r) * N + 32 * j, acc[r], 128);
  }
  return y;
}
