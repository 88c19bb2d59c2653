// X = (I + L)^-1 for a 64 x 64 strictly lower L, in place, by one warpgroup (128 threads).
// a: 64 x 64 float32 row-major shared memory holding L below the diagonal (what is on and
// above it is ignored); on return it holds X (unit diagonal, zeros above). scratch: 4 x 256
// floats of shared memory (one 16 x 16 block a warp). tx: the thread's index in the group;
// bar: a named barrier id the group's 128 threads sync on.
//
// Warp w owns row block w (rows 16 w .. 16 w + 15). With Ld the 16 x 16 diagonal blocks of
// L, Lo the rest, D = (I + Ld)^-1 and N = D Lo (strictly block lower, N^4 = 0):
//   I + L = (I + Ld)(I + N),  X = (I - N + N^2 - N^3) D,
// so each warp forms D_w (forward substitution, a column a lane) and N_wj = D_w L_wj alone,
// the group exchanges them once through `a`, and block (w, j) of X is
//   X_10 = -N_10 D_0;  X_21 = -N_21 D_1;  X_20 = (N_21 N_10 - N_20) D_0;  X_32 = -N_32 D_2;
//   X_31 = Y D_1 with Y = N_32 N_21 - N_31;  X_30 = (N_32 N_20 - Y N_10 - N_30) D_0.
// Products are tf32 tensor-core MMAs (m16n8k8, f32 accumulation), the precision of the
// blocked substitution this replaces; its operands are read from shared memory by their
// fragment layouts, so `a` needs no particular swizzle.

__device__ __forceinline__ unsigned la_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// c (16 x 16, the two 16 x 8 accumulator halves, 4 floats each) += A B, A and B 16 x 16
// blocks of row-major shared matrices with leading dims lda, ldb.
__device__ __forceinline__ void la_mma16(float* c, const float* A, int lda, const float* B,
                                         int ldb, int lane) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const float* a0 = A + g * lda + 8 * kk + t;
    unsigned x0 = la_tf32(a0[0]), x1 = la_tf32(a0[8 * lda]);
    unsigned x2 = la_tf32(a0[4]), x3 = la_tf32(a0[8 * lda + 4]);
#pragma unroll
    for (int nh = 0; nh < 2; ++nh) {
      const float* b0 = B + (8 * kk + t) * ldb + 8 * nh + g;
      unsigned y0 = la_tf32(b0[0]), y1 = la_tf32(b0[4 * ldb]);
      float* d = c + 4 * nh;
      asm volatile(
          "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(y0), "r"(y1));
    }
  }
}

// The accumulator element (r, j) of a 16 x 16 block: c[la_at(r, j)] at lane 4 (r % 8) + (j % 8) / 2.
// r = g or g + 8, column 8 nh + 2 t + e: c[4 nh + 2 (r >= 8) + e].
__device__ __forceinline__ void la_load16(float* c, const float* S, int ld, int lane) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nh = 0; nh < 2; ++nh)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) c[4 * nh + 2 * h + e] = S[(g + 8 * h) * ld + 8 * nh + 2 * t + e];
}

__device__ __forceinline__ void la_store16(float* S, int ld, const float* c, float sign,
                                           int lane) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nh = 0; nh < 2; ++nh)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        S[(g + 8 * h) * ld + 8 * nh + 2 * t + e] = sign * c[4 * nh + 2 * h + e];
}

__device__ __forceinline__ void la_zero16(float* c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = 0.0f;
}

__device__ __forceinline__ void la_group_sync(int bar) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void la_wy_inverse64(float* a, float* scratch, int tx, int bar) {
  const int ld = 64;
  int w = (tx >> 5) & 3, lane = tx & 31;
  float* rows = a + 16 * w * ld;          // this warp's row block
  float* dw = rows + 16 * w;              // its diagonal block
  // D_w: lane c (and c + 16, the same) solves column c % 16 of (I + L_ww) x = e_c,
  // right-looking: each x_j found updates the rows below it independently.
  {
    int col = lane & 15;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = (i == col) ? 1.0f : 0.0f;
#pragma unroll
    for (int j = 0; j < 15; ++j) {
#pragma unroll
      for (int i = j + 1; i < 16; ++i) x[i] -= dw[i * ld + j] * x[j];
    }
    __syncwarp();
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) dw[i * ld + col] = x[i];
    }
    __syncwarp();
  }
  // N_wj = D_w L_wj (j < w), over L_wj once all are formed
  float n[3][8];
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    la_zero16(n[j]);
    if (j < w) la_mma16(n[j], dw, ld, rows + 16 * j, ld, lane);
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 3; ++j)
    if (j < w) la_store16(rows + 16 * j, ld, n[j], 1.0f, lane);
  la_group_sync(bar);                     // every D_j and N_ij written
  const float* D0 = a;
  const float* D1 = a + 16 * ld + 16;
  const float* D2 = a + 32 * ld + 32;
  const float* N10 = a + 16 * ld;
  const float* N20 = a + 32 * ld;
  const float* N21 = a + 32 * ld + 16;
  const float* N30 = a + 48 * ld;
  const float* N31 = a + 48 * ld + 16;
  const float* N32 = a + 48 * ld + 32;
  float* sw = scratch + 256 * w;          // this warp's 16 x 16 block
  float x[3][8];                          // X_wj, j < w
#pragma unroll
  for (int j = 0; j < 3; ++j) la_zero16(x[j]);
  float z[8];
  if (w == 1) {
    la_mma16(x[0], N10, ld, D0, ld, lane);                 // -X_10
#pragma unroll
    for (int i = 0; i < 8; ++i) x[0][i] = -x[0][i];
  } else if (w == 2) {
    la_mma16(x[1], N21, ld, D1, ld, lane);                 // -X_21
    la_load16(z, N20, ld, lane);
#pragma unroll
    for (int i = 0; i < 8; ++i) { x[1][i] = -x[1][i]; z[i] = -z[i]; }
    la_mma16(z, N21, ld, N10, ld, lane);                   // N_21 N_10 - N_20
    la_store16(sw, 16, z, 1.0f, lane);
    __syncwarp();
    la_mma16(x[0], sw, 16, D0, ld, lane);
  } else if (w == 3) {
    la_mma16(x[2], N32, ld, D2, ld, lane);                 // -X_32
    la_load16(z, N31, ld, lane);
#pragma unroll
    for (int i = 0; i < 8; ++i) { x[2][i] = -x[2][i]; z[i] = -z[i]; }
    la_mma16(z, N32, ld, N21, ld, lane);                   // Y = N_32 N_21 - N_31
    la_store16(sw, 16, z, 1.0f, lane);
    __syncwarp();
    la_mma16(x[1], sw, 16, D1, ld, lane);                  // X_31 = Y D_1
    float y[8];
    la_zero16(y);
    la_mma16(y, sw, 16, N10, ld, lane);                    // Y N_10
    la_load16(z, N30, ld, lane);
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] = -z[i] - y[i];
    la_mma16(z, N32, ld, N20, ld, lane);                   // N_32 N_20 - Y N_10 - N_30
    __syncwarp();
    la_store16(sw, 16, z, 1.0f, lane);
    __syncwarp();
    la_mma16(x[0], sw, 16, D0, ld, lane);                  // X_30
  }
  la_group_sync(bar);                     // every N_ij and D_j read
#pragma unroll
  for (int j = 0; j < 3; ++j)
    if (j < w) la_store16(rows + 16 * j, ld, x[j], 1.0f, lane);
  la_zero16(z);
#pragma unroll
  for (int j = 1; j < 4; ++j)
    if (j > w) la_store16(rows + 16 * j, ld, z, 1.0f, lane);
}
