// What one CPUID costs on this machine: under a hypervisor (a VM, WSL2) it is a VM exit, whose time a guest's profiler
// does not see. Why the library asks the CPU once per process (common.h: cpu_has, probe_isa).
// Not part of the library; docs/benchmarks.md ("CPUID once") uses it:
//   g++ -O2 csrc/probes/cpuid_cost.cpp -o /tmp/cpuid_cost && /tmp/cpuid_cost
#include <cpuid.h>
#include <chrono>
#include <cstdio>
int main() {
    for (int r = 0; r < 3; r++) {
        unsigned a, b, c, d, sink = 0;
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 20000; i++) {
            __get_cpuid_count(1, 0, &a, &b, &c, &d);
            sink += c;
        }
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 20000;
        printf("cpuid leaf 1: %.2f us each (%u)\n", us, sink & 1);
    }
}
