def add_bench_cpu_experts(sub):
    pass
