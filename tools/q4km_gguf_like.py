"""A full-size Q4_K_M GGUF of a random MoE model for llama.cpp, written without the bf16 conversion a full-size model
needs (61 GB for Qwen3-30B-A3B, more than the benchmark machine's disk holds beside the rest): the metadata, tokenizer
and non-layer tensors of llama.cpp's own Q4_K_M conversion of a 1-layer model of the same shapes
(`moechat bench random-model DIR --like qwen3-30b-a3b --layers 1`, then `../shared/peers/llamacpp.sh DIR q4_k_m`);
every layer's tensors in the types llama-quantize's Q4_K_M gives LAYERS layers of that architecture (src/llama-quant.cpp:
Q4_K, but attn_v and ffn_down(_exps) Q6_K where use_more_bits(i, LAYERS); norms and router F32, copied), with random
blocks whose fp16 scales are finite. The side-by-side partner of `bench random-model --gptq` (docs/benchmarks.md,
"Full size"). Needs llama.cpp's gguf-py on PYTHONPATH (the peers cache: .../vendor/llama.cpp/gguf-py).
usage: python tools/q4km_gguf_like.py ONE_LAYER_Q4_K_M.gguf OUT.gguf [LAYERS (default 48)]"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

src, dst = sys.argv[1], sys.argv[2]
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 48
r = GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = GGUFWriter(dst, arch)
for key, f in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    value = layers if key == f"{arch}.block_count" else f.contents()
    sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
    w.add_key_value(key, value, f.types[0], sub)

def more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

BLOCK = {Q.Q4_K: (144, [(0, 1e-4), (2, 1e-4)]), Q.Q6_K: (210, [(208, 1e-5)])}  # bytes per 256 weights, fp16 fields
rng = np.random.default_rng(0)

def random_blocks(qtype, weights):
    size, halves = BLOCK[qtype]
    b = np.frombuffer(rng.bytes(weights // 256 * size), np.uint8).reshape(-1, size).copy()
    for off, val in halves:
        b[:, off:off + 2] = np.frombuffer(np.float16(val).tobytes(), np.uint8)
    return b

plan = []  # (name, numpy byte shape, raw type, data maker)
for t in r.tensors:
    if not t.name.startswith("blk."):
        plan.append((t.name, t.data.shape, t.tensor_type, lambda t=t: np.asarray(t.data)))
for i in range(layers):
    for t in r.tensors:
        if not t.name.startswith("blk.0."):
            continue
        name = f"blk.{i}." + t.name[len("blk.0."):]
        if t.tensor_type == Q.F32:
            plan.append((name, t.data.shape, t.tensor_type, lambda t=t: np.asarray(t.data)))
            continue
        qt = Q.Q6_K if (".attn_v." in name or ".ffn_down" in name) and more_bits(i, layers) else Q.Q4_K
        ne = [int(x) for x in t.shape]  # ggml order: ne0 first
        weights = int(np.prod(ne))
        shape = tuple(reversed(ne[1:])) + (ne[0] // 256 * BLOCK[qt][0],)
        plan.append((name, shape, qt, lambda qt=qt, weights=weights, shape=shape: random_blocks(qt, weights).reshape(shape)))
for name, shape, qt, _ in plan:
    nbytes = int(np.prod(shape)) * (4 if qt == Q.F32 else 1)
    w.add_tensor_info(name, shape, np.float32 if qt == Q.F32 else np.uint8, nbytes,
                      raw_dtype=None if qt == Q.F32 else qt)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
for _, _, qt, make in plan:
    data = make()
    w.write_tensor_data(data.astype(np.float32) if qt == Q.F32 else data)
w.close()
print(dst, layers, "layers", sum(int(np.prod(s)) * (4 if q == Q.F32 else 1) for _, s, q, _ in plan) / 1e9, "GB")
