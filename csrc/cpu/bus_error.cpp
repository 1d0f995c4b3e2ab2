// A bus error (SIGBUS): a page of a mapped file that the kernel cannot supply, as when a model file moechat reads in
// place (the mmap'd checkpoint, the quantized experts' cache) is truncated or copied over while it runs, or the disk
// fails. The process cannot go on; without a handler it died without a word. This one writes the text it was given (the
// app's terminal reset while its TUI holds the terminal, then one line; a SIGBUS no file caused, sent by kill or a
// machine-check memory error, the reset alone), then ends the process by the same signal, so that the shell restores the
// terminal's modes as after any crash (engine/native.py: report_bus_errors).
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
std::atomic<size_t> g_len{0}, g_before{0};  // the text's bytes, the first g_before of them the terminal reset
std::atomic<int> g_taken{0};

// Whether the fault is a mapped page the kernel could not supply (a file), not a signal sent or a hardware memory error.
bool from_a_file(const siginfo_t* info) {
    if (info->si_code == SI_USER || info->si_code == SI_QUEUE) return false;
#ifdef SI_TKILL
    if (info->si_code == SI_TKILL) return false;  // raise, tgkill
#endif
#ifdef BUS_MCEERR_AR
    if (info->si_code == BUS_MCEERR_AR || info->si_code == BUS_MCEERR_AO) return false;
#endif
    return true;
}

void on_bus_error(int sig, siginfo_t* info, void*) {
    if (g_taken.exchange(1)) {  // another thread faulted first (the pool's threads read the same file): it ends the process
        for (;;) pause();
    }
    for (size_t done = 0, n = from_a_file(info) ? g_len.load() : g_before.load(); done < n;) {
        ssize_t wrote = write(2, g_text + done, n - done);
        if (wrote <= 0) break;
        done += size_t(wrote);
    }
    signal(sig, SIG_DFL);
    raise(sig);  // blocked in this handler: delivered as it returns, with the default action
}

}  // namespace

// From now on a bus error writes `before` then `line` to stderr (one no file caused: `before` alone) and ends the process
// by SIGBUS. 0, or -1 where it cannot be installed.
API int moe_report_bus_errors(const char* before, const char* line) {
    const size_t b = std::min(strlen(before), sizeof g_text), n = std::min(b + strlen(line), sizeof g_text);
    g_len.store(0);  // a fault meanwhile writes nothing rather than half a text
    g_before.store(0);
    memcpy(g_text, before, b);
    memcpy(g_text + b, line, n - b);
    g_before.store(b);
    g_len.store(n);
    struct sigaction action = {};
    action.sa_sigaction = on_bus_error;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, nullptr);
}

#else

API int moe_report_bus_errors(const char*, const char*) { return -1; }  // Windows: no SIGBUS

#endif
