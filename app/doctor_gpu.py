"""`moechat doctor --gpu`: the CUDA path checked end to end on this machine, in under a minute.

A small random Qwen3-30B-A3B-shaped model (4 layers, hidden 256, 128 experts of width 256; written to a
temporary directory by `bench random-model`'s code, nothing downloaded) runs on the GPU, and each part
prints one line with PASS or FAIL and what to do:
  cuda         PyTorch sees a usable GPU (the one `--device auto` picks)
  equality     greedy output of the engine on CUDA (experts split between the GPU and the CPU, MoE-SpAc
               with the self drafter; every expert on the CPU; every expert on the GPU, its MoE layers inside the
               graphed passes) equals Hugging Face's on CUDA, float32
  pinned       the RAM tier is page-locked, so copies to the GPU are asynchronous DMA
  copies       after generation every resident slot holds its expert's bytes exactly and is ready
  overlap      the CPU experts ran on the worker thread while the GPU ran the resident ones
  graphs       the decode passes' dense path was captured as CUDA graphs and replayed (engine/model/graph_decode.py)
  kernels      the Triton kernels that read int8 and int4 slots in place give the dequantizing twin's outputs
Exit status 0 when every part passes, 1 otherwise (and on a machine without a usable GPU, after one line).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from ..engine import INSTALLER

PROMPT = [11, 42, 7, 300, 1024, 5, 99, 2048, 17, 3]
NEW_TOKENS = 24
OVERLAP_SHARE = 0.25  # the share of CPU expert time that must run beside the engine thread's work, not waited for
FIX_DRIVER = f"update the NVIDIA driver, or reinstall moechat with {INSTALLER} for a matching PyTorch CUDA build"
NO_GPU_FIX = f"with an NVIDIA GPU in this machine, install its driver (nvidia-smi lists the GPU), then run {INSTALLER} again"
REPORT = "report it with this output (moechat doctor --gpu --json) at the project's issue tracker"


def run_gpu_checks(as_json: bool) -> int:
    from ..engine import NO_GPU, best_gpu, probe_cuda

    t0 = time.perf_counter()
    cuda = probe_cuda()
    if cuda.problem or not cuda.gpus:
        why = cuda.problem or NO_GPU  # a CPU build of PyTorch beside a GPU: its problem says to reinstall
        fix = NO_GPU_FIX if not cuda.problem else "" if INSTALLER in cuda.problem else FIX_DRIVER
        print(json.dumps({"ok": False, "checks": [_row("cuda", False, why, fix)]}) if as_json else
              f"moechat doctor --gpu: {why}: nothing to check on this machine" + (f" ({fix})" if fix else ""))
        return 1
    gpu = best_gpu(cuda.gpus)  # the one `--device auto` runs on
    rows = [_row("cuda", True, f"cuda:{gpu.index} {gpu.name}, {gpu.free_bytes / 2**30:.1f} GiB free", "")]
    # Windows cannot delete a file still mapped (the tiny model's weights, until the engines are collected): left behind
    with tempfile.TemporaryDirectory(prefix="moechat-doctor-", ignore_cleanup_errors=True) as tmp:
        model_dir = _tiny_model(Path(tmp))
        rows += _checks(model_dir, f"cuda:{gpu.index}")
    ok = all(r["ok"] for r in rows)
    if as_json:
        print(json.dumps({"ok": ok, "seconds": time.perf_counter() - t0, "checks": rows}))
    else:
        for r in rows:
            print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['part']:9} {r['detail']}" + (f" -> {r['fix']}" if not r["ok"] else ""))
        print(f"{'all parts pass' if ok else 'some parts FAIL'} ({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


def _row(part: str, ok: bool, detail: str, fix: str) -> dict:
    return {"part": part, "ok": ok, "detail": detail, "fix": fix}


def _tiny_model(out: Path) -> Path:
    from .bench.random_model import random_config, write_random_checkpoint

    cfg = random_config("qwen3-30b-a3b", layers=4, hidden=256, intermediate=256, dtype="float32")
    cfg.max_position_embeddings = 512
    write_random_checkpoint(out, cfg, seed=0)
    return out


def _checks(model_dir: Path, device: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from ..engine import Engine, EngineConfig, Request, SamplingParams, SchedulerConfig, SpecConfig, StepStats

    rows = []
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)
    expected = out[0, len(PROMPT):].tolist()
    del hf
    torch.cuda.empty_cache()

    def run(ratio: float, drafter: str):
        engine = Engine(EngineConfig(model_dir=str(model_dir), device=device, dtype="float32", expert_cache_ratio=ratio,
                                     spec=SpecConfig(drafter=drafter), scheduler=SchedulerConfig(policy="spac")))
        return engine, list(engine.generate(Request(token_ids=PROMPT), SamplingParams(max_new_tokens=NEW_TOKENS)))

    cpu_only, events = run(0.0, "none")
    cpu_only.close()
    mismatches = [] if events[-1].token_ids == expected else ["every expert on the CPU"]
    on_gpu, events = run(1.0, "none")  # every expert fits: MoE layers inside the graphed passes (resident.py)
    on_gpu.close()
    if events[-1].token_ids != expected:
        mismatches.append("every expert on the GPU")
    mixed, events = run(0.5, "self")  # kept open for the checks of its slots below
    if events[-1].token_ids != expected:
        mismatches.append("spac + self drafter, half the experts on the GPU")
    steps = [e for e in events if isinstance(e, StepStats)]
    rows.append(_row("equality", not mismatches, "greedy output equals Hugging Face's on CUDA" if not mismatches else
                     f"greedy output differs from Hugging Face's: {', '.join(mismatches)}", REPORT))

    m = mixed.model
    rows.append(_row("pinned", m.store.pinned and _first_pinned(m.store),
                     "the RAM tier is page-locked" if m.store.pinned else "the RAM tier is pageable: copies stage",
                     "free RAM" + ("" if sys.platform == "win32" else " or raise the locked-memory limit (ulimit -l)") +
                     "; pageable copies work but are slower"))
    rows.append(_slot_check(m))
    rows.append(_graph_check(m))
    rows.append(_kernel_check(m.device))
    cpu = sum(s.cpu_s for s in steps)
    dev = sum(s.device_s for s in steps)
    hidden = cpu - sum(s.cpu_wait_s for s in steps)  # CPU expert time the engine thread did not wait for
    overlapped = m.runtime.has_cpu_thread and cpu > 0 and dev > 0 and hidden > OVERLAP_SHARE * cpu
    rows.append(_row("overlap", overlapped,
                     f"CPU experts {cpu * 1e3:.1f} ms on the worker thread, {max(hidden, 0) * 1e3:.1f} ms of it beside the "
                     f"engine thread's GPU work; GPU experts {dev * 1e3:.1f} ms",
                     "check that no other process saturates the CPU, then report it"))
    mixed.close()
    return rows


def _graph_check(m) -> dict:
    """The engine's passes after the prompt replayed captured graphs (the eager passes gave the tokens checked above)."""
    captured, failed = getattr(m.lean, "captured", 0), getattr(m.lean, "failed", None)  # graph_decode.GraphedDecode's
    ok = captured > 0 and failed is None
    detail = (f"{captured} segment graphs captured and replayed" if ok else f"capture failed: {failed}" if failed else
              "no decode pass ran in a CUDA graph")
    return _row("graphs", ok, detail, "decoding still works without them (eagerly); " + REPORT)


def _kernel_check(device) -> dict:
    """Quantized slots on this GPU: the Triton kernels (compiled here, for this GPU) against the twin, int8 and int4, 5
    rows over 4 of 8 slots (experts 64 wide on 64 columns: whole row tiles and partial ones)."""
    import torch
    import torch.nn.functional as F

    from ..engine import cpu_ffn, grouped_expert_ffn, triton_ffn

    gen = torch.Generator().manual_seed(0)
    slot_of_row = torch.tensor([0, 2, 2, 5, 7])  # sorted, as the twin takes them
    worst = 0.0
    for fmt in ("int8", "int4"):
        gate_up, down = (cpu_ffn.quantize(torch.randn(8, r, k, generator=gen) * 0.05, fmt, fit=False).to(device)
                         for r, k in ((128, 64), (64, 64)))
        x = torch.randn(len(slot_of_row), 64, generator=gen).to(device)
        got = triton_ffn.slot_ffn(x, slot_of_row.to(device), gate_up, down, F.silu)
        if got is None:
            failed = triton_ffn.failure()
            why = failed or ("Triton is not importable" if not triton_ffn.importable() else f"{device} is not a GPU")
            return _row("kernels", failed is None, f"quantized experts run the dequantizing twin ({why})",
                        "install Triton (pip install triton) for the faster path" if failed is None else REPORT)
        ids, sizes = torch.unique_consecutive(slot_of_row, return_counts=True)
        want = grouped_expert_ffn(x, gate_up, down, ids.tolist(), sizes.tolist(), F.silu)
        worst = max(worst, float((got.float() - want).abs().max() / want.abs().max()))
    ok = worst <= 1e-4
    return _row("kernels", ok, f"the Triton kernels read int8 and int4 slots in place, {worst:.1e} from the twin at most",
                REPORT)


def _first_pinned(store) -> bool:
    gate_up = store.gate_up[0] if store.gate_up else None
    return bool(gate_up is not None and gate_up.is_pinned())


def _slot_check(m) -> dict:
    """Every resident slot's bytes equal its expert's in the store, once the copies are done."""
    import torch

    cache, store = m.cache, m.store
    cache.wait_copies()
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    resident = cache.resident_mask().nonzero().tolist()  # [[li, e], ...]
    wrong = []
    for li, e in resident:
        slot = int(cache.slot_of[li, e])
        gate_up, down = store.weights(li, e)
        if not (torch.equal(cache.gate_up[slot].cpu(), gate_up) and torch.equal(cache.down[slot].cpu(), down)):
            wrong.append((li, e))
    ok = bool(resident) and not wrong
    detail = f"{len(resident)} resident experts, every slot equal to the store" if ok else \
        "no expert was resident" if not resident else f"{len(wrong)} of {len(resident)} slots differ from the store"
    return _row("copies", ok, detail, REPORT)


def main_gpu(args) -> int:
    try:
        return run_gpu_checks(args.json)
    except Exception as err:  # a check that crashes is a failed check, in one line
        from ..engine import out_of_vram

        # its tiny model needs little: on a full GPU, what else holds it is what to free
        said = out_of_vram(err, "close programs that use the GPU and run it again") or \
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"FAIL  doctor --gpu stopped: {said}", file=sys.stderr)
        return 1
