"""Lossless: moechat greedy output equals Hugging Face `generate(do_sample=False)` token for token,
for every family, expert cache ratio, policy, drafter and draft length (the settings dealt over three checkpoints per family)."""
from __future__ import annotations

import pytest
import torch
from helpers import NEW_TOKENS, PROMPT, hf_greedy, run_engine
from tiny import FAMILIES

from moechat.engine.config import EngineConfig, SamplingParams, SpecConfig
from moechat.engine.events import Finished
from moechat.engine.generate import Engine, Request
from moechat.engine.model.bf16_linear import Bf16Linear
from moechat.engine.model.memory_estimate import estimate

RATIOS = (0.0, 0.1, 0.5, 1.0)
DRAFT_LENS = (1, 4, 8)


SEEDS = (0, 1, 2)


def _runs(seed: int) -> list[dict]:
    """The matrix of engine settings, dealt over the seeds in turn: every (ratio, policy, drafter, γ) runs on one of each
    family's three checkpoints, and each checkpoint still sees every ratio, policy and drafter."""
    drafters = [("none", 1), *(("self", g) for g in DRAFT_LENS), *(("draft", g) for g in DRAFT_LENS)]
    runs = []
    for ratio in RATIOS:
        # eam only where residency is a choice (0 < ratio < 1); test_baselines runs it across requests
        for policy in ("lru", "static", "lfu", "specmoe", "spac", "spmoe") + (("eam",) if 0 < ratio < 1 else ()):
            runs += [dict(expert_cache_ratio=ratio, policy=policy, drafter=d, draft_len=g) for d, g in drafters]
        if ratio >= 0.5:  # no CPU experts (bench e2e's on-demand row): every miss loaded before its layer
            runs += [dict(expert_cache_ratio=ratio, policy="lru", cpu_experts=False, drafter=d, draft_len=g)
                     for d, g in (("none", 1), ("self", 4))]
    return runs[seed::len(SEEDS)]


def test_the_dealt_matrix_covers_every_setting_on_every_checkpoint():
    dealt = [_runs(seed) for seed in SEEDS]
    every = [run for share in dealt for run in share]
    assert len({tuple(sorted(run.items())) for run in every}) == len(every) == 4 * 6 * 7 + 2 * 7 + 2 * 2
    for share in dealt:
        for key in ("expert_cache_ratio", "policy", "drafter", "draft_len"):
            assert {run[key] for run in share} == {run[key] for run in every}, key


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, seed, checkpoint, draft_dir, tokenizer):
    model_dir = checkpoint(family, seed)
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    assert len(expected) == NEW_TOKENS
    mismatches, rejected = [], 0
    for run in _runs(seed):
        drafter = str(draft_dir) if run["drafter"] == "draft" else run["drafter"]
        fin = run_engine(model_dir, prompt, **{**run, "drafter": drafter})
        if fin.token_ids != expected:
            mismatches.append(run)
        rejected += fin.summary.drafted - fin.summary.accepted
    assert not mismatches, f"{family} seed {seed}: differs from transformers for {mismatches}"
    assert rejected > 0  # rejection and KV trimming were exercised, not only full acceptance


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_split_runs_both_tiers(family, checkpoint, tokenizer):
    """With half the experts resident, both tiers serve activations in the same run."""
    fin = run_engine(checkpoint(family), tokenizer(PROMPT)["input_ids"], expert_cache_ratio=0.5)
    assert fin.summary.hits > 0 and fin.summary.misses > 0
    assert fin.summary.bytes_moved > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
def test_cpu_experts_on_worker_thread(family, checkpoint, tokenizer):
    """The GPU arrangement (CPU experts on a worker thread, concurrent with the fast tier), run on CPU."""
    model_dir = checkpoint(family, 1)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)))
    engine.model.runtime.use_cpu_thread(True)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert fin.token_ids == hf_greedy(model_dir, prompt)
    assert fin.summary.hits > 0 and fin.summary.misses > 0


def test_sharded_checkpoint_with_index(checkpoint, tokenizer):
    model_dir = checkpoint("qwen2_moe", 3, shards="40KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    prompt = tokenizer(PROMPT)["input_ids"]
    assert run_engine(model_dir, prompt, drafter="self").token_ids == hf_greedy(model_dir, prompt)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_disk_tier_and_byte_budget(family, checkpoint, tokenizer):
    """Experts read lazily from the mmap'd files (RAM budget below their size) and a byte-sized fast tier."""
    model_dir = checkpoint(family)
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    engine = Engine(EngineConfig(model_dir=str(model_dir), host_ram_budget_bytes=0, expert_cache_bytes=3 * 16 * 32 * 4 * 3))
    assert engine.model.store.tier == "mmap"
    assert engine.model.cache.capacity == 3
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert fin.token_ids == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_disk_tier_runs_the_native_kernel_on_per_expert_tensors(family, dtype, checkpoint, tokenizer, monkeypatch):
    """The disk tier of a checkpoint with one tensor per expert matrix (every hub MoE checkpoint: Qwen3-30B-A3B's,
    Mixtral's, whose up is not next to gate) runs the native kernel on the mapped tensors in place, as the RAM tier runs
    it on the stacked layer. It copied each expert per use (gate and up concatenated, widened to fp32) and ran PyTorch
    one expert at a time: 4-7x slower decode and prefill with the whole file in the page cache."""
    from moechat.engine.experts import cpu_ffn

    if cpu_ffn.library() is None:
        pytest.skip(cpu_ffn.notice())
    model_dir = checkpoint(family, 8, dtype=dtype, **({"intermediate_size": 32} if family == "mixtral" else {}))
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt, 24)
    engine = Engine(EngineConfig(model_dir=str(model_dir), host_ram_budget_bytes=0, spec=SpecConfig("self", 4)))
    store = engine.model.store
    assert store.tier == "mmap" and not store.fused and store.dtype == dtype
    copy, runtime = store.weights, engine.model.runtime

    def weights(li, e):  # a prefill's large groups go to a GEMM (NATIVE_MAX_TOKENS), as the RAM tier's do
        assert runtime.mode.phase == "prefill", f"a {runtime.mode.phase} pass copied an expert out of the mapped file"
        return copy(li, e)

    monkeypatch.setattr(store, "weights", weights)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=24)))[-1]
    assert isinstance(fin, Finished), fin
    assert fin.token_ids == expected


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and out[-1][1] == start:
            out[-1][1] = end
        else:
            out.append([start, end])
    return [tuple(s) for s in out]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_disk_tier_reads_the_routed_experts_ahead(family, checkpoint, tokenizer, monkeypatch):
    """Before the native kernel reads the disk tier's experts in place, the OS is asked to read exactly those experts'
    bytes (Checkpoint.will_need: MADV_WILLNEED where a page is not in the page cache; cold experts came by one page
    fault's read-around at a time): each call's ranges are, joined, the kernel's experts' gate, up and down. Same tokens."""
    from moechat.engine.experts import cpu_ffn

    if cpu_ffn.library() is None:
        pytest.skip(cpu_ffn.notice())
    model_dir = checkpoint(family, 9, **({"intermediate_size": 32} if family == "mixtral" else {}))
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    engine = Engine(EngineConfig(model_dir=str(model_dir), host_ram_budget_bytes=0))
    store, ckpt = engine.model.store, engine.model.store.ckpt
    assert store.tier == "mmap" and not store.fused
    asked, calls = [], []
    will_need, kernel = ckpt.will_need, cpu_ffn.moe_ffn_native_ptrs

    def record_will_need(path, start, end):
        asked.append((ckpt._bases[path] + start, ckpt._bases[path] + end))  # addresses in the mapping
        return will_need(path, start, end)

    def record_kernel(x, ptrs, w_dtype, inter, *args, **kw):
        size = inter * x.shape[1] * w_dtype.itemsize  # gate, up and down: I x H each
        calls.append((_joined([(a, a + size) for a in ptrs.flatten().tolist()]), _joined(asked)))
        asked.clear()
        return kernel(x, ptrs, w_dtype, inter, *args, **kw)

    monkeypatch.setattr(ckpt, "will_need", record_will_need)
    monkeypatch.setattr(cpu_ffn, "moe_ffn_native_ptrs", record_kernel)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert fin.token_ids == expected
    assert len(calls) >= NEW_TOKENS and not asked
    for read, wanted in calls:
        assert wanted == read


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_fast_tier_copies_from_the_disk_tier_read_the_expert_ahead(quant, checkpoint, tokenizer, monkeypatch):
    """A copy into a fast-tier slot (a GPU's, here the CPU's) from the disk tier asks the OS for exactly that expert's
    ranges first (ExpertStore.will_need), as the CPU kernels' reads do, rather than one read-around page fault at a
    time. Same tokens."""
    model_dir = checkpoint("qwen3_moe", 9, moe_intermediate_size=64)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = Engine(EngineConfig(model_dir=str(model_dir), quant=quant, host_ram_budget_bytes=0, expert_cache_ratio=0.5))
    store, cache = engine.model.store, engine.model.runtime.cache
    assert store.tier == "mmap" and cache.capacity > 0
    ckpt = store._layer_spans(0)[0]  # the mapped files the experts are read from
    asked, copies = [], []
    will_need, weights = ckpt.will_need, store.weights

    def record_will_need(path, start, end):
        asked.append((path, start, end))
        will_need(path, start, end)
        return True  # as if every page were missing: each of the expert's ranges is then asked

    def record_copy(slot, li, e, level):
        asked.clear()  # the CPU kernels' own requests before this copy
        copying.append(True)
        try:
            return copy(slot, li, e, level)
        finally:
            copying.clear()

    def record_weights(li, e):
        if copying:  # the copy's read of the expert
            copies.append((sorted(store._layer_spans(li)[1][e]), sorted(set(asked))))
        return weights(li, e)

    copy, copying = cache._copy, []
    monkeypatch.setattr(ckpt, "will_need", record_will_need)
    monkeypatch.setattr(cache, "_copy", record_copy)
    monkeypatch.setattr(store, "weights", record_weights)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert copies and all(wanted == read for wanted, read in copies)
    assert fin.token_ids == run_engine(model_dir, prompt, NEW_TOKENS, quant=quant).token_ids


def test_will_need_asks_for_the_pages_not_in_the_page_cache(checkpoint, monkeypatch):
    """Checkpoint.will_need: MADV_WILLNEED on the range from its page's start, only where a page is not resident (asking
    walks the page cache: ~110 µs per resident 9 MiB expert, the mincore check ~10 µs)."""
    import mmap

    from moechat.engine.model import checkpoint as ck

    if not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip("no madvise on this system")
    model_dir = checkpoint("qwen3_moe")
    ckpt = ck.Checkpoint(model_dir)
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    path, start, end = ckpt.byte_range(key)
    assert not ckpt.will_need(path, start, end)  # not mapped yet: nothing to ask
    ckpt.view(key).sum()  # mapped and read: resident

    class Recorder:
        def __init__(self):
            self.calls = []

        def madvise(self, *args):
            self.calls.append(args)

    real, ckpt._maps[path] = ckpt._maps[path], Recorder()
    assert not ckpt.will_need(path, start, end) and ckpt._maps[path].calls == []
    monkeypatch.setattr(ck, "all_resident", lambda address, length: False)
    assert ckpt.will_need(path, start, end)
    first = start - start % mmap.PAGESIZE
    assert ckpt._maps[path].calls == [(mmap.MADV_WILLNEED, first, end - first)] and start % mmap.PAGESIZE
    ckpt._maps[path] = real


def _resident_pages(path) -> set[int]:
    """The file's pages in the page cache (mincore on a mapping of its own)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    pages = ctypes.create_string_buffer((len(m) + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    assert libc.mincore(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m), pages) == 0
    m.close()
    return {i for i, v in enumerate(pages.raw) if v & 1}


def _evict(ckpt) -> None:
    """A checkpoint's files out of the page cache: the mappings' page-table entries dropped (never written), then the pages
    (written back first: a file just written keeps its dirty pages)."""
    import mmap
    import os

    for path, m in ckpt._maps.items():
        m.madvise(mmap.MADV_DONTNEED)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_disk_tier_stack_reads_the_routed_quantized_experts_ahead(checkpoint, monkeypatch):
    """int4 experts on the disk tier decode inside the native stack, read in place from the cache file: an expert is six
    ranges (q, scale and minimum of gate_up and down, each field stacked over the experts). Cold, each came in by page
    faults that read the device's read-around window, mostly other experts' bytes (745 MB read for a token's 94 MB of
    a Qwen3-30B-A3B shape on an 8 MiB read-ahead disk). After each layer's top-k the stack asks the OS for exactly the
    routed experts' pages: with the cache files evicted before every pass, a pass leaves those pages in the page cache
    and no others. The same tokens as the RAM tier."""
    import mmap

    from moechat.engine.experts import cpu_ffn
    from moechat.engine.model import decode_stack

    if cpu_ffn.library() is None or not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip(cpu_ffn.notice() or "no madvise on this system")
    model_dir = checkpoint("qwen3_moe", 5, moe_intermediate_size=1024)  # an expert's gate_up codes: 8 pages
    prompt = list(range(5, 25))
    engine = Engine(EngineConfig(model_dir=str(model_dir), quant="int4", host_ram_budget_bytes=0))
    store, qfile = engine.model.store, engine.model.store.qfile._mapped
    assert store.tier == "mmap" and engine.model.decode_path() == "lean, the layer stack in one native call"
    _evict(qfile)
    if any(_resident_pages(path) for path in qfile._maps):
        pytest.skip("this file system keeps the cache files' pages (tmpfs?)")
    passes, forward = [], decode_stack.DecodeStack.forward

    def cold_forward(self, ids, *args):
        if self.runtime.store is not store:  # the RAM tier's engine below
            return forward(self, ids, *args)
        _evict(qfile)
        logits = forward(self, ids, *args)
        wanted = set()
        for row, li in self.sparse.items():
            for e in self._outputs[ids.shape[1]][0][row].unique().tolist():  # the pass's routed experts
                for key in (f"{li}.{name}.{field}" for name in ("gate_up", "down") for field in ("q", "scale", "minimum")):
                    path, start, end = qfile.byte_range(key)
                    size = (end - start) // store.num_experts
                    first, last = start + e * size, start + (e + 1) * size - 1
                    wanted |= {(path, page) for page in range(first // mmap.PAGESIZE, last // mmap.PAGESIZE + 1)}
        passes.append((wanted, {(path, page) for path in qfile._maps for page in _resident_pages(path)}))
        return logits

    monkeypatch.setattr(decode_stack.DecodeStack, "forward", cold_forward)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=8)))[-1]
    engine.close()
    assert len(passes) == 7  # every decode step
    for wanted, resident in passes:
        assert resident == wanted
    assert fin.token_ids == run_engine(model_dir, prompt, 8, quant="int4").token_ids  # the RAM tier's (its own mapping)


def _expert_pages(qfile, li: int, e: int, num_experts: int) -> set[tuple]:
    """(file, page) of one int4 expert's six ranges in its layer's cache file."""
    import mmap

    pages = set()
    for key in (f"{li}.{name}.{field}" for name in ("gate_up", "down") for field in ("q", "scale", "minimum")):
        path, start, end = qfile.byte_range(key)
        size = (end - start) // num_experts
        first, last = start + e * size, start + (e + 1) * size - 1
        pages |= {(path, page) for page in range(first // mmap.PAGESIZE, last // mmap.PAGESIZE + 1)}
    return pages


@pytest.mark.parametrize("stack", [True, False])
def test_disk_tier_op_by_op_reads_the_routed_quantized_experts_ahead(stack, checkpoint, monkeypatch):
    """Outside the native stack (the prompt's prefill; with the stack set aside, every step: cpu_direct) the disk tier's
    int4 experts came in by page faults, each reading the device's read-around window of mostly other experts (a 4-token
    prefill read 1.06 GB for 209 MB of routed experts of a Qwen3-30B-A3B shape). ExpertStore.will_need now asks the OS
    for exactly the routed experts' ranges: with the cache files evicted before every pass, a pass leaves those pages in
    the page cache and no others. The same tokens as the RAM tier."""
    import gc
    import mmap

    from moechat.engine.experts import cpu_ffn
    from moechat.engine.model.loader import LoadedModel

    if cpu_ffn.library() is None or not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip(cpu_ffn.notice() or "no madvise on this system")
    model_dir = checkpoint("qwen3_moe", 5, moe_intermediate_size=1024)  # an expert's gate_up codes: 8 pages
    prompt = list(range(5, 25))
    engine = Engine(EngineConfig(model_dir=str(model_dir), quant="int4", host_ram_budget_bytes=0))
    model, store, qfile = engine.model, engine.model.store, engine.model.store.qfile._mapped
    if not stack:
        model.lean.stack = None
    assert store.tier == "mmap" and model.decode_path() == ("lean, the layer stack in one native call" if stack else
                                                            "lean, native ops")
    gc.collect()  # an earlier test's engine that mapped the same cache files: its mapped pages stay in the page cache
    _evict(qfile)
    if any(_resident_pages(path) for path in qfile._maps):
        pytest.skip("this file system keeps the cache files' pages (tmpfs?)")
    passes, routed, forward, run_layer = [], set(), LoadedModel.forward, model.runtime.run_layer

    def record_layer(li, x, idx, weights):
        routed.update((li, e) for e in idx.reshape(-1).tolist())
        return run_layer(li, x, idx, weights)

    def cold_forward(self, ids, cache, keep):
        if self is not model:  # the RAM tier's engine below
            return forward(self, ids, cache, keep)
        _evict(qfile)
        routed.clear()
        logits = forward(self, ids, cache, keep)
        wanted = set().union(*(_expert_pages(qfile, li, e, store.num_experts) for li, e in routed))
        passes.append((ids.shape[1], wanted, {(path, page) for path in qfile._maps for page in _resident_pages(path)}))
        return logits

    monkeypatch.setattr(model.runtime, "run_layer", record_layer)
    monkeypatch.setattr(LoadedModel, "forward", cold_forward)
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=8)))[-1]
    engine.close()
    assert [n for n, _, _ in passes] == [len(prompt)] + [1] * 7  # the prefill, then every decode step
    for _, wanted, resident in passes if not stack else passes[:1]:  # the stack's own steps: the test above
        assert wanted and resident == wanted
    assert fin.token_ids == run_engine(model_dir, prompt, 8, quant="int4").token_ids  # the RAM tier's (its own mapping)


def test_two_threads_opening_a_file_at_once_share_one_mapping(checkpoint, monkeypatch):
    """The disk tier's kernel keeps raw addresses into a file's mapping (ExpertStore.expert_pointers, on the CPU-expert
    thread, while the engine thread maps experts for the GPU): a second thread that mapped the same file meanwhile
    replaced the first mapping in the dict, which nothing then kept, so the addresses pointed into unmapped memory."""
    import mmap
    import threading

    from moechat.engine.model import checkpoint as ck

    ckpt = ck.Checkpoint(checkpoint("qwen3_moe"))
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    real, maps, other, threads = mmap.mmap, [], {}, []

    def mapping(*args, **kwargs):  # the first thread, mid-mmap: the other one opens the same file
        maps.append(real(*args, **kwargs))
        made = maps[-1]
        if len(maps) == 1:
            threads.append(threading.Thread(target=lambda: other.update(view=ckpt.view(key))))
            threads[0].start()
            threads[0].join(2)  # it waits for this mapping to be made: the join times out
        return made

    monkeypatch.setattr(ck.mmap, "mmap", mapping)
    first = ckpt.view(key)
    threads[0].join(60)
    assert len(maps) == 1 and other["view"].data_ptr() == first.data_ptr()


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "qwen2_moe", "deepseek_v2"])
def test_bf16_checkpoint(family, checkpoint, tokenizer):
    """A bf16 checkpoint computed in float32 equals transformers in float32, its experts kept in bf16 where the native
    kernel computes them (exact widening: store.storage_dtype) through the decode stack, a CPU fast tier (PyTorch on
    widened slots) and the disk tier; computed in bf16 it runs end to end."""
    from moechat.engine.experts import cpu_ffn

    model_dir = checkpoint(family, 4, dtype=torch.bfloat16)
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    model = Engine(EngineConfig(model_dir=str(model_dir))).model
    kept = model.store
    assert kept.dtype == (torch.float32 if cpu_ffn.library() is None else torch.bfloat16) == kept.gate_up[0].dtype
    # the dense linears too (bf16_linear.narrow_linears): every one but the routers (MLA's kv_b_proj included: model/mla.py
    # reads it per head in place), read as bf16, computed in fp32
    linears = {name: m for name, m in model.hf.named_modules() if isinstance(m, torch.nn.Linear)}
    narrowed = {name for name, m in linears.items() if type(m) is Bf16Linear and m.weight.dtype == torch.bfloat16}
    routers = {name for name in linears if name.endswith("mlp.gate")}
    assert narrowed == (set() if cpu_ffn.library() is None else set(linears) - routers), set(linears) - narrowed
    held = sum(p.numel() * p.element_size() for p in model.hf.parameters())
    assert estimate(str(model_dir), "float32", cpu=True).non_expert_bytes == held  # what calibration and auto count
    if family in ("qwen3_moe", "qwen2_moe") and cpu_ffn.library() is not None:  # one native call per pass reads them
        assert model.lean.stack is not None and model.lean.stack.head.w16
        sparse = [layer for layer in model.lean.stack.layers if layer.router]
        assert sparse and all(bool(layer.shared_gate.w16 and layer.qkv_bias) == (family == "qwen2_moe") for layer in sparse)
    assert run_engine(model_dir, prompt, drafter="self").token_ids == expected
    assert run_engine(model_dir, prompt, expert_cache_ratio=0.5, policy="spac").token_ids == expected
    assert run_engine(model_dir, prompt, host_ram_budget_bytes=0).token_ids == expected
    engine = Engine(EngineConfig(model_dir=str(model_dir), dtype="bfloat16", spec=SpecConfig("self", 4)))
    assert engine.model.store.gate_up[0].dtype == torch.bfloat16
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=16)))[-1]
    assert len(fin.token_ids) == 16


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_checkpoints_long_prompt_prefills_through_the_widened_gemm_exactly(family, checkpoint, tokenizer, monkeypatch):
    """A prompt longer than the native kernel's rows (NATIVE_MAX_ROWS) multiplies the bf16 dense weights widened a block at
    a time, on oneDNN where the CPU is AMD's (fp32_gemm): transformers' greedy tokens in float32."""
    from moechat.engine.experts import cpu_ffn
    from moechat.engine.model import bf16_linear

    if cpu_ffn.library() is None:
        pytest.skip("native kernels not built: no bf16 dense linears")
    widened, real = [], bf16_linear.widened_linear
    monkeypatch.setattr(bf16_linear, "widened_linear", lambda *args: widened.append(args[0].shape) or real(*args))
    model_dir = checkpoint(family, 4, dtype=torch.bfloat16)
    prompt = tokenizer(" ".join([PROMPT] * 6))["input_ids"]
    assert len(prompt) > bf16_linear.NATIVE_MAX_ROWS
    assert run_engine(model_dir, prompt, drafter="self").token_ids == hf_greedy(model_dir, prompt)
    assert any(shape[-2] == len(prompt) for shape in widened)  # the prompt's rows went through it


def test_engine_serves_many_requests(checkpoint, tokenizer):
    """One engine, several requests: residency carries over, output stays exact."""
    model_dir = checkpoint("mixtral", 5)
    engine = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)))
    for text in (PROMPT, "Hello! How are you today?", PROMPT):
        prompt = tokenizer(text)["input_ids"]
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=24)))[-1]
        assert fin.token_ids == hf_greedy(model_dir, prompt, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_cuda(family, checkpoint, draft_dir, tokenizer):
    model_dir = checkpoint(family, 0)
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt, device="cuda")
    for ratio in RATIOS:
        for drafter in ("none", "self", str(draft_dir)):
            fin = run_engine(model_dir, prompt, device="cuda", expert_cache_ratio=ratio, drafter=drafter, draft_len=4)
            assert fin.token_ids == expected, (family, ratio, drafter)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_disk_tier_beside_a_gpu(quant, checkpoint, tokenizer):
    """Experts read from the mapped files beside a GPU, half of them on its fast tier: copies from pageable pages
    (staged by the copier, each expert's ranges asked of the disk first: ExpertStore.will_need) and the CPU tier
    reading them in place (float: moe_ffn_native_ptrs); the tokens of every expert in RAM, and where the experts are
    not quantized, transformers' greedy on the GPU."""
    model_dir = checkpoint("qwen3_moe", 9, moe_intermediate_size=64)
    prompt = tokenizer(PROMPT)["input_ids"]
    tokens = []
    for ram in (0, None):
        engine = Engine(EngineConfig(model_dir=str(model_dir), device="cuda", quant=quant, host_ram_budget_bytes=ram,
                                     expert_cache_ratio=0.5, spec=SpecConfig("self", 4)))
        assert engine.model.store.tier == ("mmap" if ram == 0 else "ram") and engine.model.cache.capacity > 0
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
        engine.close()
        assert isinstance(fin, Finished), fin
        tokens.append(fin.token_ids)
    assert tokens[0] == tokens[1]
    if quant == "none":
        assert tokens[0] == hf_greedy(model_dir, prompt, device="cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_with_no_ratio_set_a_gpu_caches_what_its_vram_holds(device, checkpoint, tokenizer, monkeypatch):
    """No expert cache ratio or size set on CUDA: the fast tier is max_cache_experts(estimate, VRAM) experts, the VRAM the
    free memory held to vram_budget_bytes (engine/model/loader.py check_load_budgets). A budget of the fixed part, the
    margin and 5.5 experts' bytes, far below what an 80-140 GB card has free, so the budget decides: 5 of the 16 experts
    cached, greedy as transformers' on the GPU. The CPU variant runs the same arithmetic through check_load_budgets as
    for a CUDA device with 139 GiB free (the engine itself needs one)."""
    from moechat.engine.model.loader import check_load_budgets
    from moechat.engine.model.memory_budgets import max_cache_experts, vram_fixed, vram_margin

    model_dir = checkpoint("qwen3_moe")
    est = estimate(model_dir, "float32", context_len=512)
    budget = vram_fixed(est) + vram_margin(1 << 30) + 5 * est.expert_bytes + est.expert_bytes // 2
    assert vram_margin(budget) == vram_margin(1 << 30) and max_cache_experts(est, budget) == 5 < est.num_experts_total
    cfg = EngineConfig(model_dir=str(model_dir), device="cuda", context_len=512, vram_budget_bytes=budget)
    assert cfg.expert_cache_ratio is None and cfg.expert_cache_bytes is None
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (139 << 30, 141 << 30))
        fitted, notice = check_load_budgets(cfg, est, torch.device("cuda"))
        assert (fitted.expert_cache_bytes, notice) == (5 * est.expert_bytes, "")
        return
    assert torch.cuda.mem_get_info()[0] > budget  # the budget decides, not what is free
    engine = Engine(cfg)
    try:
        assert engine.model.cache.capacity == 5 and engine.model.load_notice == ""
        prompt = tokenizer(PROMPT)["input_ids"]
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    finally:
        engine.close()
    assert isinstance(fin, Finished) and fin.token_ids == hf_greedy(model_dir, prompt, device="cuda")


def test_tied_embeddings(checkpoint, tokenizer):
    model_dir = checkpoint("olmoe", 6, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    prompt = tokenizer(PROMPT)["input_ids"]
    assert run_engine(model_dir, prompt, expert_cache_ratio=0.5).token_ids == hf_greedy(model_dir, prompt)


def test_fused_expert_layout(checkpoint, tokenizer, tmp_path):
    """Checkpoints that store each layer's experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoint("qwen3_moe", 7)
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for layer in (0, 2):  # the sparse layers of the tiny qwen3_moe
        pre = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(8)]
        up = [tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(8)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{pre}.down_proj"] = torch.stack(down)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(src, prompt)
    assert run_engine(dst, prompt, expert_cache_ratio=0.5, drafter="self").token_ids == expected
    assert run_engine(dst, prompt, expert_cache_ratio=0.5, host_ram_budget_bytes=0).token_ids == expected
    # quantized straight from the fused views: the same cache, so the same tokens, as from the per-expert tensors
    assert run_engine(dst, prompt, quant="int4").token_ids == run_engine(src, prompt, quant="int4").token_ids


@pytest.mark.parametrize("lean", [True, False])
def test_a_draft_with_a_smaller_padded_vocabulary(lean, checkpoint, tokenizer, tokenizer_dir, tmp_path):
    """The target (vocab 320, its tokenizer 300 ids) answers ids past a draft whose vocab is 300: the draft was fed them
    and the request failed ("native decode stack failed at a token id outside the vocabulary", or an IndexError)."""
    import tiny

    model_dir = checkpoint("qwen3_moe", 3)
    draft = tiny.make_draft(tmp_path / "draft300", tokenizer_dir, seed=11, vocab=300)
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    assert max(expected) >= 300  # the case: an id the draft has no row for is committed and fed to it
    assert run_engine(model_dir, prompt, drafter=str(draft), draft_len=3, lean_decode=lean).token_ids == expected


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 3.5]}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize("rope, positions", [(LONGROPE, 128), (DYNAMIC, 32)])
def test_rope_that_rescales_with_the_length_keeps_the_context_where_it_does_not(rope, positions, checkpoint, tokenizer):
    """transformers picks dynamic and longrope tables per forward from its longest position: past the bound the tables
    follow the passes' shapes (verification windows, prompts in passes, kept prefixes), and the self drafter's tokens
    differed from its at the 10th. The model's own context is cut to the bound, with a notice; a longer one set is refused."""
    from moechat.engine.errors import CheckpointError

    model_dir = checkpoint("qwen3_moe", 2, rope_parameters=rope, max_position_embeddings=positions)
    prompt = tokenizer(PROMPT)["input_ids"]
    new = 32 - len(prompt) - 1
    expected = hf_greedy(model_dir, prompt, new)
    for drafter in ("none", "self"):
        engine = Engine(EngineConfig(model_dir=str(model_dir), spec=SpecConfig(drafter, 4)))
        assert engine.model.context_len == 32
        assert rope is DYNAMIC or any("rescales every position once a sequence passes 32 tokens" in n for n in engine.notices)
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=new)))[-1]
        assert fin.token_ids == expected, drafter
    with pytest.raises(CheckpointError, match="set the context length to 32 or less"):
        Engine(EngineConfig(model_dir=str(model_dir), context_len=200))


def test_a_context_past_the_models_positions_is_said(checkpoint):
    """A context set past max_position_embeddings (a rope that does not rescale) loaded without a word: the model has
    never seen those positions, and the chat trims its history only at the larger context."""
    model_dir = checkpoint("qwen3_moe", 2, max_position_embeddings=64)
    past = Engine(EngineConfig(model_dir=str(model_dir), context_len=100))
    assert past.model.context_len == 100  # it runs, as transformers runs it
    assert any("100 tokens is past the 64 positions" in n for n in past.notices), past.notices
    for context in (None, 64):
        assert not any("past the" in n for n in Engine(EngineConfig(model_dir=str(model_dir), context_len=context)).notices)


@pytest.mark.parametrize("drafter", ["none", "self", "draft"])
def test_a_reply_cut_at_the_context_matches_transformers(drafter, checkpoint, draft_dir, tokenizer):
    """Near the end of the context the drafts shrink to the positions left: the last tokens are still transformers'."""
    model_dir = checkpoint("qwen3_moe", 1)
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt, 10)
    engine = Engine(EngineConfig(model_dir=str(model_dir), context_len=len(prompt) + 10, expert_cache_ratio=0.5,
                                 spec=SpecConfig(str(draft_dir) if drafter == "draft" else drafter, 8)))
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=100)))[-1]
    assert fin.token_ids == expected and fin.summary.finish_reason in ("length", "eos")
