// The prefetch engine's library (csrc/cuda/prefetch.cpp) as Python's ctypes meets it on Windows: loaded by path the way
// ctypes.CDLL loads it (LoadLibraryEx, the DLL's own folder and those os.add_dll_directory added: FOLDER, where
// engine/experts/native_copier.py found cudart64_*.dll), its entry points looked up by name.
// - the host build (-DMOECHAT_HOST_BACKEND, it has moechat_pf_hold): the cycle tests/native/test_native_copier.py runs on
//   Linux, here on Windows' threads: priority order and every byte, cancel_below and cancel, bounded in-flight copies
//   with the stream held, staging, a replaced queued item, six segments, a timed wait_idle, destroy with work queued or
//   held, a null handle, bad arguments, and two threads queuing and querying at once;
// - the "cuda" build: it loads (cudart64_*.dll resolved), and where there is no driver or no device (wine) creating an
//   engine fails with NULL and one readable line from moechat_pf_last_error(), no crash, no hang; with a device, starts.
// Prints one line per check, then "ok" (exit 0) or the failures (exit 1); 2 when the library cannot be loaded.
// Not part of the library; tests/native/test_windows_build.py cross-compiles it with MinGW and runs it under wine:
//   x86_64-w64-mingw32-g++ -O2 -std=c++17 csrc/probes/prefetch_check.cpp -o prefetch_check.exe -static
//   wine prefetch_check.exe libmoechat_prefetch_host-*.dll  |  wine prefetch_check.exe libmoechat_cuda-*.dll FOLDER
//   g++ -O2 -std=c++17 csrc/probes/prefetch_check.cpp -o /tmp/prefetch_check -ldl -lpthread  (Linux: dlopen)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifdef _WIN32
#include <windows.h>
static void* open_library(const char* path, const char* folder) {
    if (folder) {  // os.add_dll_directory(folder)
        wchar_t wide[MAX_PATH];
        MultiByteToWideChar(CP_UTF8, 0, folder, -1, wide, MAX_PATH);
        if (!AddDllDirectory(wide)) return nullptr;
    }  // ctypes.CDLL on Python 3.8+: the path made absolute, its default winmode
    char full[MAX_PATH];
    if (!GetFullPathNameA(path, MAX_PATH, full, nullptr)) return nullptr;
    void* lib = (void*)LoadLibraryExA(full, nullptr, LOAD_LIBRARY_SEARCH_DEFAULT_DIRS | LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR);
    if (!lib) std::fprintf(stderr, "LoadLibraryEx: error %lu\n", GetLastError());
    return lib;
}
static void* symbol(void* lib, const char* name) { return (void*)GetProcAddress((HMODULE)lib, name); }
#else
#include <dlfcn.h>
static void* open_library(const char* path, const char*) { return dlopen(path, RTLD_NOW); }
static void* symbol(void* lib, const char* name) { return dlsym(lib, name); }
#endif

namespace {

struct Counters {
    uint64_t bytes, copies, staged_bytes, cancelled, queued, in_flight;
    double busy_s;
};

enum { IDLE = 0, QUEUED = 1, IN_FLIGHT = 2, READY = 3 };

struct Api {
    const char* (*last_error)();
    void* (*create)(int, int, int, int);
    void (*destroy)(void*);
    int (*enqueue)(void*, int, int, int, int, const void* const*, void* const*, const size_t*, int);
    int (*query)(void*, int);
    int (*cancel)(void*, int);
    int (*cancel_below)(void*, int, int, int32_t*, int);
    int (*mark_compute)(void*, void*);
    void (*pause)(void*, int);
    void (*hold)(void*, int);
    int (*wait_idle)(void*, double);
    int (*counters)(void*, Counters*);
    int (*issued)(void*, int32_t*, int);

    explicit Api(void* lib) {
        last_error = (const char* (*)())symbol(lib, "moechat_pf_last_error");
        create = (void* (*)(int, int, int, int))symbol(lib, "moechat_pf_create");
        destroy = (void (*)(void*))symbol(lib, "moechat_pf_destroy");
        enqueue = (int (*)(void*, int, int, int, int, const void* const*, void* const*, const size_t*, int))symbol(
            lib, "moechat_pf_enqueue");
        query = (int (*)(void*, int))symbol(lib, "moechat_pf_query");
        cancel = (int (*)(void*, int))symbol(lib, "moechat_pf_cancel");
        cancel_below = (int (*)(void*, int, int, int32_t*, int))symbol(lib, "moechat_pf_cancel_below");
        mark_compute = (int (*)(void*, void*))symbol(lib, "moechat_pf_mark_compute");
        pause = (void (*)(void*, int))symbol(lib, "moechat_pf_pause");
        hold = (void (*)(void*, int))symbol(lib, "moechat_pf_hold");
        wait_idle = (int (*)(void*, double))symbol(lib, "moechat_pf_wait_idle");
        counters = (int (*)(void*, Counters*))symbol(lib, "moechat_pf_counters");
        issued = (int (*)(void*, int32_t*, int))symbol(lib, "moechat_pf_issued");
    }
    bool complete() const {
        return last_error && create && destroy && enqueue && query && cancel && cancel_below && pause && wait_idle &&
               counters && issued && mark_compute;
    }
};

int failures = 0;

void check(bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    failures += !ok;
}

std::vector<uint8_t> randoms(size_t n, uint32_t seed) {  // an LCG: the same bytes on every platform
    std::vector<uint8_t> v(n);
    for (auto& x : v) seed = seed * 1664525u + 1013904223u, x = uint8_t(seed >> 24);
    return v;
}

struct Buffers {  // n experts of `bytes` each, and their slots (zeroed)
    std::vector<std::vector<uint8_t>> src, dst;
    Buffers(int n, size_t bytes) {
        for (int i = 0; i < n; ++i) src.push_back(randoms(bytes, 7u + i)), dst.emplace_back(bytes, 0);
    }
    bool landed(int i, int from) const { return dst[i] == src[from]; }
    bool untouched(int i) const { return dst[i] == std::vector<uint8_t>(dst[i].size(), 0); }
};

int put(const Api& pf, void* e, int slot, int layer, int level, const uint8_t* src, uint8_t* dst, size_t bytes, bool pinned) {
    const void* srcs[1] = {src};
    void* dsts[1] = {dst};
    return pf.enqueue(e, slot, layer, level, 1, srcs, dsts, &bytes, pinned);
}

std::vector<int32_t> issued(const Api& pf, void* e) {
    std::vector<int32_t> out(4096);
    out.resize(pf.issued(e, out.data(), int(out.size())));
    return out;
}

bool wait_for(const Api& pf, void* e, uint64_t in_flight) {  // the engine thread got to it (no deadline of milliseconds)
    for (int i = 0; i < 100000; ++i) {
        Counters c{};
        pf.counters(e, &c);
        if (c.in_flight == in_flight) return true;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return false;
}

void priority_order(const Api& pf) {  // queued while paused, then served highest level first, FIFO within a level
    const int levels[] = {1, 3, 0, 3, 4, 1, 2, 0, 4, 2}, n = 10;
    Buffers b(n, 3000);
    void* e = pf.create(0, n, 5, 2);
    pf.pause(e, 1);
    for (int s = 0; s < n; ++s) {  // two segments each, "gate_up" and "down"
        const void* srcs[2] = {b.src[s].data(), b.src[s].data() + 2000};
        void* dsts[2] = {b.dst[s].data(), b.dst[s].data() + 2000};
        const size_t bytes[2] = {2000, 1000};
        pf.enqueue(e, s, 0, levels[s], 2, srcs, dsts, bytes, 1);
    }
    Counters c{};
    pf.counters(e, &c);
    check(c.queued == n && b.untouched(0), "paused: ten items queued, none issued");
    pf.pause(e, 0);
    check(pf.wait_idle(e, 30) == 0, "wait_idle: served");
    const std::vector<int32_t> want = {4, 8, 1, 3, 6, 9, 0, 5, 2, 7};
    check(issued(pf, e) == want, "issued highest level first, FIFO within a level");
    bool all = true;
    for (int s = 0; s < n; ++s) all = all && b.landed(s, s) && pf.query(e, s) == READY;
    pf.counters(e, &c);
    check(all && c.bytes == 3000u * n && c.copies == unsigned(n) && c.staged_bytes == 0 && c.in_flight == 0,
          "every byte landed, every slot READY, the counters");
    pf.destroy(e);
}

void cancellation(const Api& pf) {
    const int layer[] = {0, 0, 0, 1, 0, 0}, level[] = {1, 3, 0, 1, 2, 1};
    Buffers b(6, 512);
    void* e = pf.create(0, 6, 4, 2);
    pf.pause(e, 1);
    for (int s = 0; s < 6; ++s) put(pf, e, s, layer[s], level[s], b.src[s].data(), b.dst[s].data(), 512, 1);
    int32_t out[6];
    const int n = pf.cancel_below(e, 0, 2, out, 6);
    std::vector<int32_t> got(out, out + n);
    check(got == std::vector<int32_t>({2, 0, 5}), "cancel_below: layer 0's items below level 2 (lowest first), layer 1's kept");
    check(pf.cancel_below(e, 0, 2, out, 6) == 0 && pf.cancel(e, 4) == 1 && pf.cancel(e, 4) == 0, "cancel: once");
    check(pf.cancel_below(e, 0, 2, out, 5) == -1 && std::strstr(pf.last_error(), "room for num_slots"),
          "cancel_below without room: -1 and why");
    pf.pause(e, 0);
    check(pf.wait_idle(e, 30) == 0 && issued(pf, e) == std::vector<int32_t>({1, 3}), "only the kept items issued");
    bool right = true;
    for (int s = 0; s < 6; ++s) right = right && (s == 1 || s == 3 ? b.landed(s, s) : b.untouched(s));
    Counters c{};
    pf.counters(e, &c);
    check(right && c.cancelled == 4, "cancelled slots never written");
    pf.destroy(e);
}

void held_stream(const Api& pf) {  // a busy compute stream: two copies in flight, the rest queued behind them
    Buffers b(6, 4097);
    void* e = pf.create(0, 6, 3, 2);
    pf.hold(e, 1);
    const int level[] = {2, 2, 1, 1};
    for (int s = 0; s < 4; ++s) put(pf, e, s, 0, level[s], b.src[s].data(), b.dst[s].data(), 4097, 0);
    check(wait_for(pf, e, 2), "held: two copies in flight");
    int q[5];
    for (int s = 0; s < 5; ++s) q[s] = pf.query(e, s);
    check(q[0] == IN_FLIGHT && q[1] == IN_FLIGHT && q[2] == QUEUED && q[3] == QUEUED && q[4] == IDLE && b.untouched(0),
          "IN_FLIGHT, QUEUED, IDLE; nothing copied");
    check(pf.wait_idle(e, 0.05) == 1, "wait_idle times out while the stream is held");
    put(pf, e, 3, 0, 1, b.src[5].data(), b.dst[3].data(), 4097, 0);  // slot 3 reused: replaces its queued item
    pf.hold(e, 0);
    check(pf.wait_idle(e, 30) == 0, "let go: served");
    bool right = b.landed(0, 0) && b.landed(1, 1) && b.landed(2, 2) && b.landed(3, 5);
    for (int s = 0; s < 4; ++s) right = right && pf.query(e, s) == READY;
    Counters c{};
    pf.counters(e, &c);
    check(right && pf.query(e, 4) == IDLE && c.staged_bytes == 4u * 4097 && c.bytes == c.staged_bytes && c.cancelled == 1 &&
              c.busy_s > 0,
          "pageable sources staged, the replaced item never landed");
    pf.destroy(e);
}

void six_segments(const Api& pf) {  // a quantized expert: values, scales, zero points of gate_up and down
    const size_t sizes[6] = {4096, 64, 32, 2048, 32, 16};
    for (int pinned : {1, 0}) {
        Buffers b(6, 4096);
        const void* srcs[6];
        void* dsts[6];
        for (int i = 0; i < 6; ++i) srcs[i] = b.src[i].data(), dsts[i] = b.dst[i].data();
        void* e = pf.create(0, 1, 2, 2);
        const int rc = pf.enqueue(e, 0, 0, 1, 6, srcs, dsts, sizes, pinned);
        bool right = rc == 0 && pf.wait_idle(e, 30) == 0 && pf.query(e, 0) == READY;
        for (int i = 0; i < 6; ++i) right = right && !std::memcmp(b.dst[i].data(), b.src[i].data(), sizes[i]);
        Counters c{};
        pf.counters(e, &c);
        check(right && c.copies == 1 && c.bytes == 6288 && c.staged_bytes == (pinned ? 0u : 6288u),
              pinned ? "six segments, pinned: one item" : "six segments, staged: one item");
        check(pf.enqueue(e, 0, 0, 1, 7, srcs, dsts, sizes, 1) == -1 && std::strstr(pf.last_error(), "1..6 copies"),
              "seven segments: -1 and why");
        pf.destroy(e);
    }
}

void destroy_busy(const Api& pf) {  // destroy drops what is queued, lets what was issued finish, and returns
    std::vector<uint8_t> src = randoms(1 << 20, 3);
    for (int stall = 0; stall < 2; ++stall) {
        std::vector<std::vector<uint8_t>> dst(64, std::vector<uint8_t>(1 << 20, 0));
        void* e = pf.create(0, 64, 2, 2);
        (stall ? pf.hold : pf.pause)(e, 1);
        for (int s = 0; s < 64; ++s) put(pf, e, s, 0, 1, src.data(), dst[s].data(), 1 << 20, 1);
        const bool reached = wait_for(pf, e, stall ? 2 : 0);
        pf.destroy(e);
        int landed = 0;
        for (auto& d : dst) landed += d == src;
        check(reached && landed == (stall ? 2 : 0), stall ? "destroy with two copies held: they finish, the rest dropped"
                                                          : "destroy with everything queued: nothing lands");
    }
}

void two_threads(const Api& pf) {  // one thread queues and cancels while another queries and waits
    const int n = 16;
    Buffers b(n, 1 << 16);
    void* e = pf.create(0, n, 4, 2);
    bool right = true;
    for (int round = 0; round < 50 && right; ++round) {
        std::thread other([&] {
            for (int s = 0; s < n; s += 2) put(pf, e, s, 0, s % 4, b.src[s].data(), b.dst[s].data(), 1 << 16, 0);
        });
        for (int s = 1; s < n; s += 2) put(pf, e, s, 1, s % 4, b.src[s].data(), b.dst[s].data(), 1 << 16, 1);
        for (int s = 0; s < n; ++s) pf.query(e, s);
        other.join();
        right = pf.wait_idle(e, 30) == 0;
        for (int s = 0; s < n; ++s) right = right && b.landed(s, s) && pf.query(e, s) == READY;
    }
    check(right, "two threads queuing and querying at once, 50 rounds");
    pf.destroy(e);
}

void arguments(const Api& pf) {
    check(pf.query(nullptr, 0) == -1 && std::strstr(pf.last_error(), "closed"), "a null handle: -1, the engine is closed");
    check(pf.mark_compute(nullptr, nullptr) == -1, "mark_compute on a null handle: -1");
    pf.pause(nullptr, 1);  // returns, rather than dereferencing NULL
    check(pf.create(0, 0, 1, 1) == nullptr && std::strstr(pf.last_error(), "at least 1"), "zero slots: NULL and why");
    std::vector<uint8_t> a(8), c(8);
    void* e = pf.create(0, 2, 3, 2);
    check(put(pf, e, 2, 0, 1, a.data(), c.data(), 8, 1) == -1 && std::strstr(pf.last_error(), "slot 2 out of range"),
          "a slot out of range: -1 and why");
    check(put(pf, e, 0, 0, 3, a.data(), c.data(), 8, 1) == -1 && std::strstr(pf.last_error(), "level 3 out of range"),
          "a level out of range: -1 and why");
    std::thread([&] { put(pf, e, 0, 0, 9, a.data(), c.data(), 8, 1); }).join();
    check(std::strstr(pf.last_error(), "level 3 out of range") != nullptr, "last_error is per thread");
    pf.destroy(e);
}

bool host_cycle(const Api& pf) {
    priority_order(pf);
    cancellation(pf);
    held_stream(pf);
    six_segments(pf);
    destroy_busy(pf);
    two_threads(pf);
    arguments(pf);
    return failures == 0;
}

void cuda_start(const Api& pf) {  // no driver or no device: NULL and one line; a device: it starts and stops
    void* e = pf.create(0, 4, 4, 2);
    const std::string why = pf.last_error();
    if (e) {
        std::printf("started on device 0\n");
        pf.destroy(e);
        return check(true, "the CUDA engine started and stopped");
    }
    std::printf("error: %s\n", why.c_str());
    check(!why.empty() && why.find('\n') == std::string::npos && why.rfind("cudaSetDevice(device) failed: ", 0) == 0,
          "no device: create is NULL, last_error one line naming cudaSetDevice");
    check(pf.query(nullptr, 0) == -1 && std::strstr(pf.last_error(), "closed"), "then a null handle: -1");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: prefetch_check LIBRARY [FOLDER]\n");
        return 2;
    }
    void* lib = open_library(argv[1], argc > 2 ? argv[2] : nullptr);
    if (!lib) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 2;
    }
    const Api pf(lib);
    check(pf.complete(), "every entry point found by name");
    if (!pf.complete()) return 1;
    std::printf(pf.hold ? "backend: host\n" : "backend: cuda\n");
    if (pf.hold)
        host_cycle(pf);
    else
        cuda_start(pf);
    std::printf(failures ? "%d failed\n" : "ok\n", failures);
    return failures ? 1 : 0;
}
