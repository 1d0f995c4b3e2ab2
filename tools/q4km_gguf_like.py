"""A full-size Q4_K_M GGUF of a random MoE model for llama.cpp, written without the bf16 conversion a full-size model
needs (61 GB for Qwen3-30B-A3B, more than the benchmark machine's disk holds beside the rest): the metadata, tokenizer
and non-layer tensors of llama.cpp's own Q4_K_M conversion of a 1-layer model of the same shapes
(`moechat bench random-model DIR --like qwen3-30b-a3b --layers 1`, then `../shared/peers/llamacpp.sh DIR q4_k_m`);
every layer's tensors in the types llama-quantize's Q4_K_M gives LAYERS layers of that architecture (src/llama-quant.cpp:
the template's types, but attn_v (Q8_0 for 8 experts, as the template has it) and ffn_down* Q6_K where
use_more_bits(i, LAYERS), else Q4_K, each falling back to Q8_0
and Q5_0 where a row is not a multiple of 256; norms and router F32, copied), with random blocks whose fp16 scales are
finite. Layer i takes the template's layer min(i, template layers - 1): a model with leading dense layers (DeepSeek's
first_k_dense_replace) needs a template of those plus one MoE layer, e.g. `--like deepseek-v2-lite --layers 2`, whose
bf16 GGUF's block_count is set to the real count before llama-quantize (llama.cpp takes 26 or 27 layers as the Lite
model that has no q_lora_rank). The side-by-side partner of `bench random-model --gptq` (docs/benchmarks.md,
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
experts = r.fields[f"{arch}.expert_count"].contents() if f"{arch}.expert_count" in r.fields else 0
w = GGUFWriter(dst, arch)
for key, f in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    value = layers if key == f"{arch}.block_count" else f.contents()
    sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
    w.add_key_value(key, value, f.types[0], sub)

def more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

# weights and bytes per block, its fp16 fields (offset, value)
BLOCK = {Q.Q4_K: (256, 144, [(0, 1e-4), (2, 1e-4)]), Q.Q5_K: (256, 176, [(0, 1e-4), (2, 1e-4)]),
         Q.Q6_K: (256, 210, [(208, 1e-5)]),
         Q.Q5_0: (32, 22, [(0, 1e-4)]), Q.Q8_0: (32, 34, [(0, 1e-5)])}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama-quant.cpp's types for rows that are not a multiple of 256
rng = np.random.default_rng(0)

def random_blocks(qtype, weights):
    per, size, halves = BLOCK[qtype]
    b = np.frombuffer(rng.bytes(weights // per * size), np.uint8).reshape(-1, size).copy()
    for off, val in halves:
        b[:, off:off + 2] = np.frombuffer(np.float16(val).tobytes(), np.uint8)
    return b

plan = []  # (name, numpy byte shape, raw type, data maker)
for t in r.tensors:
    if not t.name.startswith("blk."):
        plan.append((t.name, t.data.shape, t.tensor_type, lambda t=t: np.asarray(t.data)))
template_layers = 1 + max(int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk."))
for i in range(layers):
    src_prefix = f"blk.{min(i, template_layers - 1)}."
    for t in r.tensors:
        if not t.name.startswith(src_prefix):
            continue
        name = f"blk.{i}." + t.name[len(src_prefix):]
        if t.tensor_type == Q.F32:
            plan.append((name, t.data.shape, t.tensor_type, lambda t=t: np.asarray(t.data)))
            continue
        ne = [int(x) for x in t.shape]  # ggml order: ne0 first
        qt = t.tensor_type
        if (".attn_v." in name and experts != 8) or ".ffn_down" in name:  # 8 experts: attn_v Q8_0 in every layer
            qt = Q.Q6_K if more_bits(i, layers) else Q.Q4_K
            qt = FALLBACK[qt] if ne[0] % 256 else qt
        weights = int(np.prod(ne))
        shape = tuple(reversed(ne[1:])) + (ne[0] // BLOCK[qt][0] * BLOCK[qt][1],)
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
