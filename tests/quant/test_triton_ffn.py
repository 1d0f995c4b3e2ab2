"""The GPU's quantized-expert kernel (engine/experts/triton_ffn.py) against its twin (formats.grouped_expert_ffn) and
the CPU kernel: on the CPU through Triton's interpreter (the same kernel source the GPU compiles), on CUDA where
there is one (marked)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_engine

from moechat.engine.experts import cpu_ffn, triton_ffn
from moechat.engine.quant import formats

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test,kernels]'; CUDA PyTorch ships it)")

PROMPT = list(range(5, 25))
TOL = 2e-5  # fp32 rounding: the kernel sums exact integer block dots, the twin multiplies dequantized weights


def _slots(fmt: str, n: int, rows: int, k: int, seed: int, device="cpu") -> formats.QuantMatrix:
    """n experts' [rows, k] matrices quantized, as a fast tier's slots hold them."""
    w = torch.randn(n, rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return cpu_ffn.quantize(w, fmt).to(device)  # native where built, else its twin (bit for bit)


def _twin(x, gate_up, down, slot_of_row):
    """The twin over rows sorted by slot (its contract), put back in the rows' order."""
    order = torch.argsort(slot_of_row, stable=True)
    ids, sizes = torch.unique_consecutive(slot_of_row[order], return_counts=True)
    y = formats.grouped_expert_ffn(x[order], gate_up, down, ids.tolist(), sizes.tolist(), F.silu)
    return torch.empty_like(y).index_copy_(0, order, y)


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize(("hidden", "inter"), [(64, 32), (96, 80)], ids=["whole-steps", "ragged"])
def test_kernel_equals_the_twin(fmt, hidden, inter):
    """Rows (several per slot, slots in any order) through their slots' experts, in the interpreter: the twin's function
    within fp32 rounding. 96 columns are 3 blocks (a partial step of 4), 80 rows of down a partial tile of 64."""
    gate_up, down = _slots(fmt, 5, 2 * inter, hidden, 0), _slots(fmt, 5, hidden, inter, 1)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(2))
    slot_of_row = torch.tensor([3, 0, 3, 4, 1, 3, 0])
    with triton_ffn.on_cpu():
        assert triton_ffn.usable(gate_up, x)
        got = triton_ffn.expert_ffn(x, slot_of_row, gate_up, down, F.silu)
    want = _twin(x, gate_up, down, slot_of_row)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= TOL * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_one_projection_is_the_cpu_kernels_sum(fmt):
    """One product against the CPU kernel's scalar formula written out: per block d·dx·Σu·qx + m·ds."""
    w = _slots(fmt, 2, 32, 64, 3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with triton_ffn.on_cpu():
        acts = triton_ffn.quantize_activations(x)
        got = triton_ffn.q_matmul(acts, torch.tensor([1, 0, 1]), w)
    qx, dx, ds = acts
    u = formats.codes(w).float().view(2, 32, 2, 32)  # [slot, R, nb, 32]
    d = formats.deinterleave_scales(w.scale).float()  # [slot, R, nb]
    m = -128 * d if w.minimum is None else formats.deinterleave_scales(w.minimum).float()
    for s, slot in enumerate((1, 0, 1)):
        dots = (u[slot] * qx[s].float().view(2, 32)).sum(-1)  # [R, nb] exact
        want = (dots * (d[slot] * dx[s]) + m[slot] * ds[s]).sum(-1)
        assert torch.allclose(got[s], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantized_in_one_launch_are_the_twins_bytes(dtype):
    """Codes, scales and sums equal formats.quantize_activations' exactly: ties to even, a block of zeros, a padded tail
    (70 columns: 3 blocks, the last 6 wide), 5 blocks for a partial step of 4."""
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(9)).to(dtype)
    x[0, :4] = torch.tensor([0.5, -1.5, 2.5, 127.0])  # with amax 127 the scale is 1: exact ties
    x[0, 4:32] = 0
    x[1, 32:64] = 0  # a zero block
    with triton_ffn.on_cpu():
        qx, dx, ds = triton_ffn.quantize_activations(x)
        wide = triton_ffn.quantize_activations(torch.randn(2, 160, generator=torch.Generator().manual_seed(10)))
    want_q, want_d = formats.quantize_activations(x.float())
    assert torch.equal(qx, want_q) and torch.equal(dx, want_d)
    assert qx[0, :4].tolist() == [0, -2, 2, 127]
    assert torch.equal(ds, want_d * want_q.view(4, -1, 32).sum(-1).float())
    assert wide[0].shape == (2, 160) and torch.equal(wide[1], formats.quantize_activations(
        torch.randn(2, 160, generator=torch.Generator().manual_seed(10)))[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_slots_read_in_place_equal_the_gathered_products(dtype):
    """resident.py's experts on float slots: the kernel (rows of 80: a partial tile; 200 columns: a partial step of 64)
    against the slots' weights gathered per activation and multiplied in batches."""
    from moechat.engine.experts.resident import gathered_ffn

    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(4, 2 * 80, 200, generator=gen) * 0.05).to(dtype)  # [slots, 2I, H]
    down = (torch.randn(4, 200, 80, generator=gen) * 0.05).to(dtype)  # [slots, H, I]
    x = torch.randn(6, 200, generator=gen).to(dtype)
    slots = torch.tensor([2, 0, 2, 3, 3, 1])
    with triton_ffn.on_cpu():
        got = triton_ffn.slot_ffn(x, slots, gate_up, down, F.silu)
    want = gathered_ffn(x, slots, gate_up, down, F.silu)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_quantized_slots_gathered_are_the_twin(fmt):
    """Without the kernel, resident.py dequantizes the slots gathered per activation: the twin's function."""
    from moechat.engine.experts.resident import gathered_ffn

    gate_up, down = _slots(fmt, 5, 64, 64, 12), _slots(fmt, 5, 64, 32, 13)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(14))
    slot_of_row = torch.tensor([4, 1, 1, 0, 4])
    got, want = gathered_ffn(x, slot_of_row, gate_up, down, F.silu), _twin(x, gate_up, down, slot_of_row)
    assert (got - want).abs().max() <= TOL * want.abs().max()


def test_the_dispatcher_runs_the_kernel_for_slots_off_the_cpu(monkeypatch):
    """grouped_ffn_q takes the kernel where the slots are not on the CPU (here: the interpreter standing in), and the
    twin once the kernel has failed, said once."""
    gate_up, down = _slots("int4", 4, 64, 64, 5), _slots("int4", 4, 64, 32, 6)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    slots = torch.tensor([0, 0, 2, 3])
    calls = []
    monkeypatch.setattr(cpu_ffn, "usable", lambda *a: False)  # not the CPU kernel: as for a GPU's slots
    real = triton_ffn.expert_ffn
    monkeypatch.setattr(triton_ffn, "expert_ffn", lambda *a: calls.append(1) or real(*a))
    with triton_ffn.on_cpu():
        y = cpu_ffn.grouped_ffn_q(x, gate_up, down, slots, F.silu)
        assert calls == [1]
        monkeypatch.setattr(triton_ffn, "_failed", None)
        monkeypatch.setattr(triton_ffn, "expert_ffn", lambda *a: (_ for _ in ()).throw(RuntimeError("no sm_61 build")))
        twin = cpu_ffn.grouped_ffn_q(x, gate_up, down, slots, F.silu)
        assert triton_ffn._failed == "RuntimeError: no sm_61 build" and not triton_ffn.usable(gate_up, x)
    assert (y - twin).abs().max() <= TOL * twin.abs().max()


def test_the_engine_decodes_through_the_kernel_as_through_the_twin(checkpoint, monkeypatch, fmt="int4"):
    """Every expert resident, the fast tier computed as on a GPU (no CPU kernel): the kernel's greedy tokens with the self
    drafter are the twin's without it."""
    ck = checkpoint("qwen3_moe")
    monkeypatch.setattr(cpu_ffn, "usable", lambda *a: False)
    prompt = PROMPT[:6]  # short: the interpreter runs each program in Python
    twin = run_engine(ck, prompt, 8, quant=fmt, expert_cache_ratio=1.0).token_ids
    calls = []
    real = triton_ffn.expert_ffn
    monkeypatch.setattr(triton_ffn, "expert_ffn", lambda *a: calls.append(1) or real(*a))
    with triton_ffn.on_cpu():  # the self drafter: its draft passes and the verifications through the kernel
        assert run_engine(ck, prompt, 8, quant=fmt, expert_cache_ratio=1.0, drafter="self").token_ids == twin
    assert len(calls) > 8 and triton_ffn._failed is None


_GPUS = {75: "RTX 20", 86: "RTX 30", 89: "RTX 40", 90: "H100/H200", 120: "RTX 50"}
# Run in a process of its own: this one imported Triton with its interpreter on, which makes even tl.sum interpreted.
_AOT = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moechat.engine.experts import triton_ffn as tf

POINTERS = {"xq": "*i8", "qx": "*i8", "xd": "*fp32", "xs": "*fp32", "out": "*fp32", "row_slot": "*i64", "wq": "*i32",
            "ws": "*fp16", "wm": "*fp16", "x": "*bf16", "w": "*bf16"}  # slots: int32 words of codes, fp16 scales
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def build(fn, capability, constants, **options):
    signature = {n: "constexpr" if p.is_constexpr else POINTERS.get(n, "i32") for n, p in zip(fn.arg_names, fn.params)}
    # as a launch specializes them: pointers 16-byte aligned, sizes and strides multiples of 16 (Qwen3-30B-A3B's)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n] != "constexpr" and n != "NB"}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
                            target=GPUTarget("cuda", capability, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    usage = {k: int(v) for k, v in re.findall(r"([A-Z]+):([0-9]+)", line)}
    ptx = kernel.asm["ptx"]
    return {**usage, "fma": "fma.rn.f32" in ptx, "inexact_div": "div.full" in ptx or "div.approx" in ptx}

q_matmul, quantize, f_matmul = tf._build()
tiles = {"BR": tf.BLOCK_ROWS, "BB": tf.BLOCKS_PER_STEP}
got = {}
for cap in map(int, sys.argv[1:]):
    got[cap] = {f"q_matmul int{bits}": build(q_matmul, cap, {**tiles, "BITS": bits}) for bits in (4, 8)}
    got[cap]["f_matmul"] = build(f_matmul, cap, {"BR": tf.BLOCK_ROWS, "BK": tf.FLOAT_COLS})
    got[cap]["quantize"] = build(quantize, cap, {"BB": tf.BLOCKS_PER_STEP}, enable_fp_fusion=False)
print(json.dumps(got))
"""


def test_kernels_compile_for_gaming_and_datacenter_gpus():
    """The interpreter does not lower the kernels. Here Triton compiles them as a GPU would, no GPU needed, down to a
    cubin for RTX 20, 30, 40 and 50 cards and the H100/H200: with no register spills (local memory would cost a decode step
    more than the kernels save), and the activations' quantizer without a fused multiply-add or an approximate division (its
    rounding is the CPU kernel's only without them)."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 3):
        pytest.skip(f"Triton {triton.__version__}: the test compiles through the 3.3+ API")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", _AOT, *map(str, _GPUS)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    for cap, kernels in got.items():
        assert set(kernels) == {"q_matmul int4", "q_matmul int8", "f_matmul", "quantize"}
        for name, usage in kernels.items():
            assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and usage["REG"] < 255, (_GPUS[int(cap)], name, usage)
        assert not kernels["quantize"]["fma"] and kernels["q_matmul int4"]["fma"], _GPUS[int(cap)]  # the check can fail
        assert not kernels["quantize"]["inexact_div"], _GPUS[int(cap)]  # IEEE division, as torch's and the CPU kernel's


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_kernel_on_cuda_equals_the_twin(fmt):
    """Compiled for the GPU: the Qwen3-30B-A3B expert shape, 9 rows over 6 slots."""
    gate_up, down = _slots(fmt, 6, 1536, 2048, 8, "cuda"), _slots(fmt, 6, 2048, 768, 9, "cuda")
    x = torch.randn(9, 2048, device="cuda")
    slot_of_row = torch.tensor([5, 0, 0, 2, 3, 3, 3, 1, 4], device="cuda")
    got = triton_ffn.expert_ffn(x, slot_of_row, gate_up, down, F.silu)
    want = _twin(x, gate_up, down, slot_of_row)
    assert triton_ffn._failed is None and (got - want).abs().max() <= 1e-4 * want.abs().max()
