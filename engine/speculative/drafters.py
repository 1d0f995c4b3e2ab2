"""Drafters: who proposes the γ tokens a verification step scores.

Contract (mlx-lm style): `start(prompt_ids, target_cache, draft_kv)` once per request, after the target's
prefill (`draft_kv`: a drafter's own cache as the conversation cache kept it, rewound to the prefix shared with this
prompt, or None); `release()` at the end returns that cache, its entries those of committed tokens only, and lets it
go; `draft(committed, n, params, generator)` returns n tokens and, when sampling, the
distributions q [n, V] they were drawn from. A drafter keeps its own KV cache consistent by itself:
entries past the committed prefix are rewound (`rewind_cache`) at the start of the next `draft`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import SamplingParams, SpecConfig, prefill_passes
from ..errors import CheckpointError, MoechatError, out_of_vram
from ..events import LoadProgress
from ..model.attention import use_cuda_attention
from ..model.bf16_linear import narrow_linears
from ..model.checkpoint import Checkpoint
from ..model.config_file import read_config_dict
from ..model.kv_cache import KVCache, hf_forward
from ..model.lean_decode import build_lean_forward
from ..model.loader import LoadedModel, load_tokenizer
from ..quant.formats import QuantMatrix, dequantize
from ..shared_files import write_whole
from .rewind import rewind_cache
from .router_feed import router_feed
from .sampling import probs_from_logits, sample


def _choose(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
    if params.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits, params)
    return sample(q, generator), q


class NoDraft:
    """Plain autoregressive decoding: every step verifies just the last committed token."""

    name = "none"
    notice = ""  # a line for the user at load (SelfDraft's when it has nothing to draft with)

    def start(self, prompt_ids: list[int], target_cache, draft_kv: KVCache | None = None) -> None:
        pass

    def release(self) -> None:
        return None

    def draft(self, committed, n, params, generator):
        return [], None


class DraftModel:
    """A separate small dense checkpoint with the target's tokenizer. With the target's hidden size,
    its hidden states also go through the target's routers to tell the policy what the
    verification will need (`router_feed.py`, SP-MoE). On the CPU its one-token passes run the lean forward
    (a qwen3 or llama draft: the whole stack in one native call), as the target's decode steps do."""

    name = "model"
    notice = ""

    def __init__(self, path: str, target: LoadedModel, lean: bool = True):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no progress bars on the user's terminal

        model_dir = Path(path).expanduser()
        if not model_dir.is_dir():
            raise CheckpointError(f"draft model directory {model_dir} does not exist: pass --draft none, self, "
                                  "or the directory of a dense model with the target's tokenizer")
        raw = read_config_dict(model_dir)
        _check_same_vocab(model_dir, raw, target)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=target.dtype).to(target.device).eval()
        except Exception as err:
            if out_of_vram(err):  # the GPU is full, not the checkpoint wrong: the caller's handler says what frees it
                raise
            raise CheckpointError(
                f"cannot load the draft model in {model_dir} ({type(err).__name__}: {err}): use a dense Hugging Face checkpoint"
            ) from None
        self.target, self.target_vocab = target, int(target.hf_config.vocab_size)
        self.draft_vocab = self.model.get_input_embeddings().num_embeddings
        self.device = target.device
        if self.device.type == "cuda":  # its grouped heads folded under a mask, not copied per query head (attention.py)
            use_cuda_attention(self.model)
        # a bf16 draft computed in float32 on the CPU keeps its dense linears bf16: half the bytes a drafted token reads
        self.bf16_linears = len(narrow_linears(self.model, Checkpoint(model_dir), None, self.device, target.dtype, "none"))
        self.feed = router_feed(self.model, target)  # None: different hidden size, or nothing to prefetch into
        # the feed reads the draft's MLP inputs through module hooks, which the lean forward does not call
        self.lean = build_lean_forward(self.model, self.device, target.context_len) if lean and self.feed is None else None
        self.cache: KVCache | None = None
        self._valid = 0  # the cache's entries past this many are drafts (or in flux)

    def start(self, prompt_ids: list[int], target_cache, draft_kv: KVCache | None = None) -> None:
        """Draft on the kept cache of this conversation (entries of a prefix of the prompt) or a new one; draft()
        feeds the rest."""
        self.cache = draft_kv if draft_kv is not None else KVCache(limit=self.target.context_len)
        self._valid = self.cache.get_seq_length()

    def release(self) -> KVCache | None:
        """The cache with the entries of committed tokens only (drafts past them dropped), let go."""
        cache, self.cache = self.cache, None
        if cache is not None:
            rewind_cache(cache, self._valid)
        return cache

    @torch.inference_mode()
    def draft(self, committed, n, params, generator):
        rewind_cache(self.cache, len(committed) - 1)
        feed = committed[self.cache.get_seq_length():]
        *catch_up, last = prefill_passes(0, len(feed))  # a long catch-up (the prompt) in the target's passes
        for a, b in catch_up:
            self._draft_pass(feed[a:b])
        feed = feed[last[0]:]
        tokens, qs = [], []
        for _ in range(n):
            logits = self._draft_pass(feed)  # [V]
            token, q = _choose(logits[: self.target_vocab], params, generator)
            tokens.append(token)
            qs.append(q)
            feed = [token]
        self._valid = len(committed) - 1  # entries past these are drafts, rewound next time
        if params.greedy:
            return tokens, None
        q = torch.stack(qs).cpu()
        if q.shape[1] < self.target_vocab:  # a draft with a smaller (padded) vocab never proposes the rest
            q = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[1]))
        return tokens, q

    def _draft_pass(self, feed: list[int]) -> torch.Tensor:
        """feed appended to the draft's cache in a draft forward of the target's runtime (the router feed reports its
        demand into it) -> the last position's logits [V]."""
        # a target id past a smaller (padded) draft vocabulary: the draft reads token 0 there, which costs only acceptance
        feed = [t if t < self.draft_vocab else 0 for t in feed]
        with self.target.runtime.forward("draft", self.cache.get_seq_length()):
            logits = self._forward(torch.tensor([feed], device=self.device))
            if self.feed is not None:
                self.feed.report()
        return logits

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, T] appended to the draft's cache -> the last position's logits [V]: the lean forward for a pass after
        a past, transformers' for the first (the prompt)."""
        if self.lean is not None and self.lean.accepts(ids.shape[1], self.cache.get_seq_length()):
            return self.lean(ids, self.cache, 1)[-1]
        return hf_forward(self.model, ids, self.cache, 1)[0, -1]


def _check_same_vocab(model_dir: Path, raw: dict, target: LoadedModel) -> None:
    draft_tok = load_tokenizer(model_dir)
    if target.tokenizer is not None and draft_tok is not None:
        same = draft_tok.get_vocab() == target.tokenizer.get_vocab()
        sizes = f"{len(draft_tok)} vs {len(target.tokenizer)} tokens"
    else:
        same = int(raw.get("vocab_size", -1)) == int(target.hf_config.vocab_size)
        sizes = f"vocab_size {raw.get('vocab_size')} vs {target.hf_config.vocab_size}"
    if not same:
        raise MoechatError(
            f"draft model {model_dir} has a different vocabulary than the target ({sizes}): "
            "use a draft that shares the target's tokenizer, or --draft self"
        )


class SelfDraft:
    """The target drafts for itself with only its resident experts (SpecMoE).

    A token routed to a non-resident expert goes to the most similar resident expert of that layer
    (smallest L2 distance between the experts' weights, a table computed once). Drafting writes into
    the target's own KV cache, which then holds exact entries for the whole committed prefix; the
    draft's entries are trimmed before verification recomputes them.
    """

    name = "self"

    def __init__(self, target: LoadedModel, progress: LoadProgress | None = None):
        self.target = target
        self._dist: list[torch.Tensor] | None = None  # per sparse layer [E, E] squared L2 distances
        self._tables: dict[int, tuple[int, torch.Tensor | None]] = {}  # li -> (cache version, remap [E])
        cache = target.cache
        if 0 < cache.capacity < cache.slot_of.numel():  # a remap will be needed: the table now, with the load's progress
            self.distances(progress)
        # no resident expert: every draft skips the routed experts, and verification rejects nearly all of it
        self.notice = "" if cache.capacity else (
            "the self drafter drafts with the experts on the fast tier, which holds none: its drafts are rarely accepted "
            "and slow decoding down; use --draft none" + (", or give the fast tier experts (--expert-cache-ratio)"
                                                          if target.device.type == "cuda" else " on a machine without a GPU"))

    def start(self, prompt_ids: list[int], target_cache, draft_kv: KVCache | None = None) -> None:
        self.cache = target_cache  # drafts in the target's cache: nothing of its own to keep

    def release(self) -> None:
        self.cache = None

    def distances(self, progress: LoadProgress | None = None) -> list[torch.Tensor]:
        """Per sparse layer [E, E]; computed once per checkpoint (it reads every expert: Qwen3-30B-A3B's 57 GB, products on
        the model's GPU where there is one) and cached on disk."""
        if self._dist is None:
            path = _affinity_cache_path(self.target)
            try:
                self._dist = torch.load(path, weights_only=True)
            except Exception:  # missing or corrupt (any unpickling error): recompute
                store, what = self.target.store, "expert similarities for the self drafter"
                self._dist = []
                for li in range(len(store.layers)):
                    self._dist.append(expert_distances(*store.layer_tensors(li), device=self.target.device))
                    if progress is not None:
                        progress(what, li + 1, len(store.layers))
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_whole(path, lambda tmp: torch.save(self._dist, tmp))
                except (OSError, RuntimeError):  # a read-only cache directory or a full disk (torch.save's writer
                    pass  # raises RuntimeError) only costs the recomputation next time
        return self._dist

    def remap(self, li: int) -> torch.Tensor | None:
        """[E] expert -> itself when resident, else its nearest resident expert; None when none is resident."""
        cache = self.target.cache
        version, table = self._tables.get(li, (-1, None))
        if version != cache.version:
            resident = cache.slot_of[li] >= 0  # [E]
            if not resident.any():
                table = None
            elif resident.all():  # every expert resident: itself, no table needed
                table = torch.arange(resident.numel())
            else:
                ids = resident.nonzero().flatten()  # [R]
                table = ids[self.distances()[li][:, ids].argmin(dim=1)]  # [E]; resident experts are at distance 0
            self._tables[li] = (cache.version, table)
        return table

    @torch.inference_mode()
    def draft(self, committed, n, params, generator):
        runtime = self.target.runtime
        base = self.cache.get_seq_length()  # == len(committed) - 1
        tokens, qs = [], []
        try:
            feed = committed[base:]
            for _ in range(n):
                ids = torch.tensor([feed], device=self.target.device)
                with runtime.forward("draft", self.cache.get_seq_length(), remap=self.remap):
                    logits = self.target.forward(ids, self.cache, keep=1)[-1]  # [V] float32
                token, q = _choose(logits, params, generator)
                tokens.append(token)
                qs.append(q)
                feed = [token]
        finally:
            rewind_cache(self.cache, base)
        return tokens, (None if params.greedy else torch.stack(qs).cpu())


def _affinity_cache_path(target: LoadedModel) -> Path:
    """Keyed by the checkpoint's files (path, size, mtime) and the compute dtype."""
    import hashlib

    from platformdirs import user_cache_dir

    ckpt = target.store.ckpt
    files = sorted({p for p in ckpt.key_to_file.values()})
    ident = [str(ckpt.dir.resolve()), str(target.dtype), target.store.quant]
    ident += [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    digest = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:24]
    return Path(user_cache_dir("moechat")) / "affinity" / f"{digest}.pt"


def _column_blocks(w, chunk: int, device=None):
    """w [E, R, K] (a tensor or a QuantMatrix) -> float32 [E, n] blocks of its flattened experts, on `device` (moved
    there in the stored dtype, widened there)."""
    if isinstance(w, QuantMatrix):  # a few rows at a time, dequantized where they are multiplied
        rows = max(1, chunk // w.k)
        for r in range(0, w.rows, rows):
            part = QuantMatrix(w.fmt, w.k, w.q[:, r:r + rows], w.scale[:, r:r + rows],
                               None if w.minimum is None else w.minimum[:, r:r + rows])
            yield dequantize(part.to(device) if device is not None else part).reshape(w.q.shape[0], -1)
        return
    flat = w.reshape(w.shape[0], -1)
    for j in range(0, flat.shape[1], chunk):
        yield flat[:, j:j + chunk].to(device).float()


def expert_distances(gate_up, down, chunk: int = 1 << 16, device=None) -> torch.Tensor:
    """gate_up [E, 2I, H], down [E, H, I] (tensors or quantized, on the host) -> [E, E] squared L2 distances between
    whole experts, from a Gram matrix accumulated over column chunks (float32 GEMMs on `device`, float64 sums on the
    host) so no float32 copy of the layer is made."""
    num_experts = gate_up.q.shape[0] if isinstance(gate_up, QuantMatrix) else gate_up.shape[0]
    gram = torch.zeros(num_experts, num_experts, dtype=torch.float64)
    for w in (gate_up, down):
        for block in _column_blocks(w, chunk, device):
            gram += (block @ block.T).double().cpu()
    sq = gram.diagonal()
    return (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0).float()


def make_drafter(spec: SpecConfig, target: LoadedModel, lean: bool = True, progress: LoadProgress | None = None):
    """The drafter `spec` names for this target; lean=False (`--no-lean-decode`): a draft model runs transformers'
    forward only; progress: told of the self drafter's expert table, computed at load."""
    if spec.drafter == "none":
        return NoDraft()
    if spec.drafter == "self":
        return SelfDraft(target, progress)
    return DraftModel(spec.drafter, target, lean)
