/* An experiment's interposer (benchmarks/l2promo_probe.py), not part of fa4aot: LD_PRELOADed,
 * it wraps the CuTe runtime's _cudaLaunchKernelEx, through which every CuTe-DSL artifact
 * launches, and rewrites the L2 promotion field of the kernel's TMA descriptors (its 128-byte
 * parameters) before the launch. CuTe builds those descriptors inline in the host code on every
 * call, with no option for the promotion; this lets one process time the same kernel with each.
 *
 * The descriptor format is opaque: the field's bits are learned at first use from the driver
 * itself (cuTensorMapEncodeTiled of one fixed map with each of the 4 promotions, diffed).
 *
 *   gcc -O2 -shared -fPIC -I/usr/local/cuda/include -o l2promo_shim.so l2promo_shim.c -ldl
 *
 * Control (ctypes): l2promo_set(p) with p in 0..3 (CU_TENSOR_MAP_L2_PROMOTION_*) or -1 (leave
 * the descriptors as built); l2promo_seen() returns a bitmask of the promotions found in the
 * descriptors launched since the last call (bit p set: a descriptor carried promotion p; bit 4:
 * one matched none of the 4 patterns); l2promo_patched() the count of rewritten descriptors. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int (*launch_t)(const void *config, const void *kernel, void **args);
typedef CUresult (*encode_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                             const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                             const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*pinfo_t)(void *, size_t, size_t *, size_t *);

static launch_t real_launch;
static pinfo_t kernel_pinfo, func_pinfo;
static int mode = -1, learned = 0, seen = 0;
static long patched = 0, calls = 0, tmaps = 0;
static int first_err = 0;
static uint8_t mask[128], pattern[4][128];

static int learn(void) {
  void *cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cu) return -1;
  encode_t enc = (encode_t)dlsym(cu, "cuTensorMapEncodeTiled");
  kernel_pinfo = (pinfo_t)dlsym(cu, "cuKernelGetParamInfo");
  func_pinfo = (pinfo_t)dlsym(cu, "cuFuncGetParamInfo");
  CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(cu, "cuInit");
  if (!enc || !init) return -2;
  init(0);
  cuuint64_t dims[3] = {128, 8, 4096}, strides[2] = {128 * 2, 8 * 128 * 2};
  cuuint32_t box[3] = {64, 128, 1}, es[3] = {1, 1, 1};
  CUtensorMap m[4];
  for (int p = 0; p < 4; p++) {
    memset(&m[p], 0, sizeof m[p]);
    CUresult r = enc(&m[p], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)0x7f0000000000ull, dims,
                     strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     (CUtensorMapL2promotion)p, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r) {
      fprintf(stderr, "l2promo_shim: cuTensorMapEncodeTiled: error %d\n", (int)r);
      return -3;
    }
    memcpy(pattern[p], &m[p], 128);
  }
  int nbits = 0;
  for (int i = 0; i < 128; i++) {
    mask[i] = 0;
    for (int p = 1; p < 4; p++) mask[i] |= pattern[0][i] ^ pattern[p][i];
    nbits += __builtin_popcount(mask[i]);
    for (int p = 0; p < 4; p++) pattern[p][i] &= mask[i];
  }
  fprintf(stderr, "l2promo_shim: promotion field = %d bit(s) at bytes", nbits);
  for (int i = 0; i < 128; i++)
    if (mask[i]) fprintf(stderr, " %d:0x%02x", i, mask[i]);
  fprintf(stderr, "\n");
  return nbits ? 1 : -4;
}

int l2promo_set(int p) {
  if (!learned) learned = learn();
  int was = mode;
  mode = p;
  return learned > 0 ? was : learned - 10;
}
int l2promo_seen(void) { int s = seen; seen = 0; return s; }
long l2promo_patched(void) { return patched; }
/* launches seen, 128-byte parameters seen, the first parameter-info error: for a diagnosis */
long l2promo_calls(void) { return calls; }
long l2promo_tmaps(void) { return tmaps; }
int l2promo_err(void) { return first_err; }

int _cudaLaunchKernelEx(const void *config, const void *kernel, void **args) {
  if (!real_launch) real_launch = (launch_t)dlsym(RTLD_NEXT, "_cudaLaunchKernelEx");
  calls++;
  if (learned > 0 && (kernel_pinfo || func_pinfo)) {
    for (size_t i = 0; i < 64; i++) {
      size_t off = 0, size = 0;
      CUresult r = kernel_pinfo ? kernel_pinfo((void *)kernel, i, &off, &size) : CUDA_ERROR_INVALID_VALUE;
      if (r && func_pinfo) r = func_pinfo((void *)kernel, i, &off, &size);
      if (r) {
        if (i == 0 && !first_err) first_err = (int)r;
        break;  /* past the last parameter */
      }
      if (size != 128) continue;  /* a CUtensorMap (FA4's kernels have no other 128-byte one) */
      tmaps++;
      uint8_t *d = (uint8_t *)args[i];
      int which = 4;
      for (int p = 0; p < 4 && which == 4; p++) {
        int same = 1;
        for (int j = 0; j < 128 && same; j++) same = (d[j] & mask[j]) == pattern[p][j];
        if (same) which = p;
      }
      seen |= 1 << which;
      if (mode >= 0 && which != 4) {
        for (int j = 0; j < 128; j++) d[j] = (uint8_t)((d[j] & ~mask[j]) | pattern[mode][j]);
        patched++;
      }
    }
  }
  return real_launch(config, kernel, args);
}
