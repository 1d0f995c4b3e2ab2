// A bus error (SIGBUS): a page of a mapped file that the kernel cannot supply, as when a model file moechat reads in
// place (the mmap'd checkpoint, the quantized experts' cache) is truncated or copied over while it runs, or the disk
// fails. The process cannot go on; without a handler it died without a word. This one writes the text it was given (the
// app's terminal reset while its TUI holds the terminal, then one line), then ends the process by the same signal, so
// that the shell restores the terminal's modes as after any crash (engine/native.py: report_bus_errors).
// Async-signal-safe: write, signal, raise, pause. Plain C ABI for ctypes.

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>

#define API extern "C" __attribute__((visibility("default")))

#if defined(SIGBUS) && !defined(_WIN32)
#include <unistd.h>

namespace {

char g_text[4096];
std::atomic<size_t> g_len{0};
std::atomic<int> g_taken{0};

void on_bus_error(int sig) {
    if (g_taken.exchange(1)) {  // another thread faulted first (the pool's threads read the same file): it ends the process
        for (;;) pause();
    }
    for (size_t done = 0, n = g_len.load(); done < n;) {
        ssize_t wrote = write(2, g_text + done, n - done);
        if (wrote <= 0) break;
        done += size_t(wrote);
    }
    signal(sig, SIG_DFL);
    raise(sig);  // blocked in this handler: delivered as it returns, with the default action
}

}  // namespace

// From now on a bus error writes `text` to stderr and ends the process by SIGBUS. 0, or -1 where it cannot be installed.
API int moe_report_bus_errors(const char* text) {
    size_t n = std::min(strlen(text), sizeof g_text);
    g_len.store(0);  // a fault meanwhile writes nothing rather than half a text
    memcpy(g_text, text, n);
    g_len.store(n);
    struct sigaction action = {};
    action.sa_handler = on_bus_error;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, nullptr);
}

#else

API int moe_report_bus_errors(const char*) { return -1; }  // Windows: no SIGBUS

#endif
