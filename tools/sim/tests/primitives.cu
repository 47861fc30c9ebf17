// The simulated device's primitives against known answers. Written in the CUDA dialect our
// kernels use and compiled the way the driver compiles a module (tools/sim/translate.cc, then g++
// with cuda_on_cpu.h), then launched through the same launcher template with a kernelParams
// array. `primitives` runs every check and exits nonzero naming the first failure;
// `primitives f32-to-f16 | f16-to-f32 | hadd | hmul` convert little-endian values from stdin
// to stdout, for crates/3-amp/tests/sim_primitives.rs to compare against an independent
// binary16 library.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <thread>
#include <vector>

#define FULL 0xffffffffu

extern "C" __global__ void barrier_rotate(const int* in, int* out, int rounds) {
    __shared__ int sh[1024];
    const unsigned n = blockDim.x * blockDim.y;
    const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
    int v = in[blockIdx.x * n + t];
    for (int r = 0; r < rounds; ++r) {
        sh[t] = v;
        __syncthreads();
        v = sh[(t + 1) % n];  // every write of this round is visible: the barrier held
        __syncthreads();      // nobody overwrites sh before all have read it
    }
    out[blockIdx.x * n + t] = v;
}

extern "C" __global__ void warp_ops(int* out, int width, int delta) {
    const int lane = threadIdx.x & 31;
    const int base = threadIdx.x * 8;
    int s = lane;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    out[base + 0] = s;
    out[base + 1] = __shfl_down_sync(FULL, lane * 10, delta, width);
    out[base + 2] = __shfl_up_sync(FULL, lane * 10, delta, width);
    out[base + 3] = __shfl_sync(FULL, lane * 10, 3, width);
    out[base + 4] = __shfl_xor_sync(FULL, lane * 10, delta, width);
    out[base + 5] = (int)__ballot_sync(FULL, lane % 3 == 0);
    out[base + 6] = __float_as_int(__shfl_xor_sync(FULL, 0.5f * lane, 1));
    // Half the warp in its own collective, with its own mask.
    if (lane < 16) out[base + 7] = __shfl_down_sync(0x0000ffffu, lane, 1, 16);
    else out[base + 7] = __shfl_down_sync(0xffff0000u, lane, 1, 16);
}

extern "C" __global__ void atomics(int* count, float* fsum, unsigned* bits, int* mx) {
    atomicAdd(count, 1);
    atomicAdd(fsum, 1.0f);
    atomicOr(bits, 1u << (threadIdx.x & 31));
    atomicMax(mx, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}

extern "C" __global__ void dynamic_shared(const float* in, float* out, unsigned c) {
    extern __shared__ float acc[];
    const unsigned t = threadIdx.x;
    for (unsigned i = t; i < c; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();
    atomicAdd(&acc[t % c], in[blockIdx.x * blockDim.x + t]);
    __syncthreads();
    for (unsigned i = t; i < c; i += blockDim.x) atomicAdd(&out[i], acc[i]);
}

extern "C" __global__ void poison_probe(unsigned* out) {
    extern __shared__ unsigned raw[];
    if (threadIdx.x == 0) out[blockIdx.x] = raw[0];  // never written: must not read as 0
}

extern "C" __global__ void exited_lane(int* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(FULL, (int)threadIdx.x, 1);
}

extern "C" __global__ void divergent(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x & 1) __syncthreads();
    else v = __shfl_xor_sync(FULL, v, 2);
    out[threadIdx.x] = v;
}

extern "C" __global__ void grid_ids(unsigned* out) {
    const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    out[b * blockDim.x * blockDim.y * blockDim.z + t] = b * 10000 + t;
}

extern "C" __global__ void mixed_args(double* out, char c, short s, float f, double d,
                                      unsigned long long u, const int* p) {
    if (threadIdx.x == 0) out[0] = c + s + f + d + (double)u + p[0];
}

extern "C" __global__ void ptx_cvt(const float* in, unsigned short* h, float* back) {
    const unsigned i = threadIdx.x;
    unsigned short x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(in[i]));
    h[i] = x;
    float f;
    asm volatile("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    back[i] = f;
}

extern "C" __global__ void nothing(int* out) {
    if (out) out[blockIdx.x * blockDim.x + threadIdx.x] += 1;
}

// ---------------------------------------------------------------- host side
extern "C" void cudasim_runtime_stats(uint64_t* started, uint64_t* stacks);

static int failures = 0;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
            ++failures;                                                    \
        }                                                                  \
    } while (0)

static char last_error[512];

template <class K>
static int launch(K kernel, dim3 grid, dim3 block, unsigned shared, std::vector<void*> params) {
    last_error[0] = 0;
    cudasim_launch l{grid, block, shared, params.data(), last_error, sizeof last_error};
    return cudasim_launch_kernel(kernel, &l);
}

static void test_barrier() {
    const unsigned blocks = 3;
    for (dim3 block : {dim3(256), dim3(33), dim3(16, 8), dim3(1024)}) {
        const unsigned n = block.x * block.y;
        std::vector<int> in(blocks * n), out(blocks * n, -1);
        for (unsigned i = 0; i < in.size(); ++i) in[i] = (int)(i * 7 + 1);
        const int* pin = in.data();
        int* pout = out.data();
        int rounds = 5;
        CHECK(launch(barrier_rotate, dim3(blocks), block, 0, {&pin, &pout, &rounds}) == 0, "%s",
              last_error);
        for (unsigned b = 0; b < blocks; ++b)
            for (unsigned t = 0; t < n; ++t)
                CHECK(out[b * n + t] == in[b * n + (t + rounds) % n],
                      "barrier_rotate block %u thread %u of %u: %d", b, t, n, out[b * n + t]);
    }
}

static void test_warps() {
    for (int width : {32, 16, 8}) {
        for (int delta : {1, 3}) {
            std::vector<int> out(64 * 8, -1);
            int* p = out.data();
            CHECK(launch(warp_ops, dim3(1), dim3(64), 0, {&p, &width, &delta}) == 0, "%s",
                  last_error);
            for (int t = 0; t < 64; ++t) {
                const int lane = t & 31, seg = lane / width * width, in_seg = lane - seg;
                const int* o = &out[t * 8];
                CHECK(o[0] == 496, "xor-reduce lane %d: %d", t, o[0]);
                const int down = in_seg + delta < width ? lane + delta : lane;
                CHECK(o[1] == down * 10, "down w%d d%d lane %d: %d", width, delta, t, o[1]);
                const int up = in_seg >= delta ? lane - delta : lane;
                CHECK(o[2] == up * 10, "up w%d d%d lane %d: %d", width, delta, t, o[2]);
                CHECK(o[3] == (seg + 3) * 10, "shfl w%d lane %d: %d", width, t, o[3]);
                const int x = lane ^ delta;
                const int xs = x < seg + width ? x : lane;
                CHECK(o[4] == xs * 10, "xor w%d d%d lane %d: %d", width, delta, t, o[4]);
                CHECK((unsigned)o[5] == 0x49249249u, "ballot lane %d: %08x", t, (unsigned)o[5]);
                float f;
                memcpy(&f, &o[6], 4);
                CHECK(f == 0.5f * (lane ^ 1), "float xor lane %d: %g", t, f);
                const int h = (lane & 15) < 15 ? lane + 1 : lane;
                CHECK(o[7] == h, "half-warp masks lane %d: %d", t, o[7]);
            }
        }
    }
}

static void test_atomics() {
    int count = 0, mx = -1;
    float fsum = 0.0f;
    unsigned bits = 0;
    int* pc = &count;
    float* pf = &fsum;
    unsigned* pb = &bits;
    int* pm = &mx;
    CHECK(launch(atomics, dim3(64), dim3(256), 0, {&pc, &pf, &pb, &pm}) == 0, "%s", last_error);
    CHECK(count == 64 * 256, "atomicAdd int: %d", count);
    CHECK(fsum == 16384.0f, "atomicAdd float: %g", fsum);  // exact: integers below 2^24
    CHECK(bits == 0xffffffffu, "atomicOr: %08x", bits);
    CHECK(mx == 64 * 256 - 1, "atomicMax: %d", mx);
}

static void test_dynamic_shared() {
    const unsigned blocks = 5, threads = 96, c = 7;
    std::vector<float> in(blocks * threads), out(c, 0.0f), want(c, 0.0f);
    for (unsigned i = 0; i < in.size(); ++i) in[i] = (float)(i % 13);
    for (unsigned b = 0; b < blocks; ++b)
        for (unsigned t = 0; t < threads; ++t) want[t % c] += in[b * threads + t];
    const float* pi = in.data();
    float* po = out.data();
    unsigned cc = c;
    CHECK(launch(dynamic_shared, dim3(blocks), dim3(threads), 2 * c * 4, {&pi, &po, &cc}) == 0,
          "%s", last_error);
    for (unsigned k = 0; k < c; ++k) CHECK(out[k] == want[k], "channel %u: %g != %g", k, out[k], want[k]);
    unsigned probe[2] = {0, 0};
    unsigned* pp = probe;
    CHECK(launch(poison_probe, dim3(2), dim3(32), 64, {&pp}) == 0, "%s", last_error);
    CHECK(probe[0] == 0xffffffffu && probe[1] == 0xffffffffu, "dynamic shared not poisoned: %08x",
          probe[0]);
}

static void test_errors() {
    std::vector<int> out(64 * 8, 0);
    int* p = out.data();
    CHECK(launch(exited_lane, dim3(1), dim3(32), 0, {&p}) != 0, "a shuffle with an exited lane ran");
    CHECK(strstr(last_error, "lane 5 has already exited") != nullptr, "message: %s", last_error);
    CHECK(launch(divergent, dim3(1), dim3(32), 0, {&p}) != 0, "a divergent barrier ran");
    CHECK(strstr(last_error, "deadlock") != nullptr, "message: %s", last_error);
    // A full mask in a partial warp (48 threads: the second warp has 16 lanes).
    int w = 32, d = 1;
    CHECK(launch(warp_ops, dim3(1), dim3(48), 0, {&p, &w, &d}) != 0, "a shuffle on missing lanes ran");
    CHECK(strstr(last_error, "does not have") != nullptr, "message: %s", last_error);
    CHECK(launch(nothing, dim3(1), dim3(1025), 0, {&p}) != 0, "1025 threads launched");
    // After errors the runtime still runs kernels.
    test_barrier();
}

static void test_geometry_and_args() {
    const dim3 grid(3, 2, 2), block(4, 3, 2);
    std::vector<unsigned> out(12 * 24, 0);
    unsigned* p = out.data();
    CHECK(launch(grid_ids, grid, block, 0, {&p}) == 0, "%s", last_error);
    for (unsigned b = 0; b < 12; ++b)
        for (unsigned t = 0; t < 24; ++t)
            CHECK(out[b * 24 + t] == b * 10000 + t, "grid_ids %u %u: %u", b, t, out[b * 24 + t]);
    double r = 0;
    double* pr = &r;
    char c = 3;
    short s = -5;
    float f = 0.25f;
    double dd = 1e10;
    unsigned long long u = 1ull << 40;
    int seven = 7;
    const int* ps = &seven;
    CHECK(launch(mixed_args, dim3(1), dim3(1), 0, {&pr, &c, &s, &f, &dd, &u, &ps}) == 0, "%s",
          last_error);
    CHECK(r == 3 - 5 + 0.25 + 1e10 + (double)(1ull << 40) + 7, "mixed_args: %.17g", r);
    const cudasim_signature* sig = cudasim_signature_of(&mixed_args);
    CHECK(sig->count == 7 && sig->params[1].size == 1 && sig->params[4].size == 8 &&
              sig->params[0].pointee_align == 8 && sig->params[6].pointee_align == 4 &&
              sig->params[3].pointee_align == 0,
          "signature of mixed_args");
}

static void test_ptx() {
    float in[4] = {1.0f, 65520.0f, 1.0f + 1.0f / 2048.0f, -0.0f};
    unsigned short h[4];
    float back[4];
    const float* pi = in;
    unsigned short* ph = h;
    float* pb = back;
    CHECK(launch(ptx_cvt, dim3(1), dim3(4), 0, {&pi, &ph, &pb}) == 0, "%s", last_error);
    CHECK(h[0] == 0x3c00 && h[1] == 0x7c00 && h[2] == 0x3c00 && h[3] == 0x8000,
          "cvt.rn.f16.f32: %04x %04x %04x %04x", h[0], h[1], h[2], h[3]);
    CHECK(back[0] == 1.0f && back[2] == 1.0f, "cvt.f32.f16");
}

// Fibers stay cheap: a kernel without rendezvous reuses one stack for all its threads.
static void test_cost() {
    uint64_t s0, k0, s1, k1;
    cudasim_runtime_stats(&s0, &k0);
    std::vector<int> out(1056 * 256, 0);
    int* p = out.data();
    timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    CHECK(launch(nothing, dim3(1056), dim3(256), 0, {&p}) == 0, "%s", last_error);
    clock_gettime(CLOCK_MONOTONIC, &b);
    cudasim_runtime_stats(&s1, &k1);
    for (int v : out) CHECK(v == 1, "nothing: %d", v);
    CHECK(s1 - s0 == 1056 * 256, "fibers started: %llu", (unsigned long long)(s1 - s0));
    CHECK(k1 - k0 == 0, "stacks allocated for a rendezvous-free kernel: %llu",
          (unsigned long long)(k1 - k0));
    const double ns = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (1056.0 * 256);
    printf("cost: %.1f ns per simulated thread (rendezvous-free kernel, 270336 threads)\n", ns);
}

static int mappings() {
    FILE* f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    int n = 0;
    for (int c; (c = fgetc(f)) != EOF;) n += c == '\n';
    fclose(f);
    return n;
}

// A thread's fiber stacks go when the thread does (a harness starts a thread per test).
static void test_thread_exit_releases_stacks() {
    const int before = mappings();
    for (int round = 0; round < 4; ++round) {
        std::thread t([] { test_barrier(); });  // 1024-thread blocks: 1024 stacks alive
        t.join();
    }
    const int after = mappings();
    // 4 rounds of 1024 stacks, two mappings each, would add 8192 if leaked; a few dozen
    // others (thread stacks, arenas) may come and go.
    CHECK(after - before < 100, "mappings grew from %d to %d across finished threads", before,
          after);
}

template <class In, class Out, class F>
static int convert(F f) {
    In x;
    while (fread(&x, sizeof x, 1, stdin) == 1) {
        const Out y = f(x);
        fwrite(&y, sizeof y, 1, stdout);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc > 1) {
        const char* m = argv[1];
        if (!strcmp(m, "f32-to-f16"))
            return convert<float, unsigned short>([](float x) { return __half_as_ushort(__float2half_rn(x)); });
        if (!strcmp(m, "f16-to-f32"))
            return convert<unsigned short, float>([](unsigned short x) { return __half2float(__ushort_as_half(x)); });
        if (!strcmp(m, "hadd") || !strcmp(m, "hmul")) {
            const bool add = !strcmp(m, "hadd");
            return convert<uint32_t, unsigned short>([add](uint32_t ab) {
                const __half a = __ushort_as_half((unsigned short)(ab & 0xffff));
                const __half b = __ushort_as_half((unsigned short)(ab >> 16));
                return __half_as_ushort(add ? __hadd(a, b) : __hmul(a, b));
            });
        }
        fprintf(stderr, "unknown mode %s\n", m);
        return 2;
    }
    test_barrier();
    test_warps();
    test_atomics();
    test_dynamic_shared();
    test_geometry_and_args();
    test_ptx();
    test_errors();
    test_cost();
    test_thread_exit_releases_stacks();
    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("all primitive checks passed\n");
    return 0;
}
