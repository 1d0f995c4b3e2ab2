"""Sampling is lossless: temperature/top-k/top-p match `transformers`, and speculative acceptance
(greedy and Leviathan rejection sampling) emits tokens distributed exactly as the target's.

The distribution tests compare empirical frequencies with exact probabilities through the total
variation distance, against a bound derived from the sample size (see `tv_bound`), so a correct
rule passes with overwhelming probability while a wrong rule (always accepting drafts, resampling
from p instead of the residual, ...) is caught (`test_distribution_check_catches_wrong_rules`).
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import tiny  # tests/ is on sys.path (conftest.py)
import torch

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Finished, StepStats
from moechat.engine.generate import Engine, Request
from moechat.engine.speculative.sampling import probs_from_logits, sample
from moechat.engine.speculative.verify import accept_greedy, accept_sampling

DELTA = 1e-4  # allowed chance that a correct sampler fails one TV check (an upper bound; see grouped_tv)


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------

def grouped_tv(groups: dict, ref: dict) -> tuple[float, float]:
    """groups: key -> list of sampled tokens; ref: key -> exact distribution [V] for that key.

    Returns (D, bound). D = sum_g (n_g / N) * TV(empirical_g, ref_g) = (1/2N) sum_g sum_j |c_gj - n_g p_gj|.
    With one group this is the plain TV between the empirical and the exact distribution.

    Bound, for samples that are independent given their group (the group may itself be random):
      * E[D] <= (1/2N) sum_g sum_j sqrt(n_g p_gj (1 - p_gj)), since E|c - n p| <= sd(c) (Jensen);
      * changing one sample moves D by at most 1/N, so by McDiarmid P(D >= E[D] + t) <= exp(-2 N t^2);
        t = sqrt(ln(1/DELTA) / (2N)).
    So a correct sampler exceeds the bound with probability below DELTA.
    """
    total = sum(len(s) for s in groups.values())
    assert total > 0
    dev, mean_bound = 0.0, 0.0
    for key, samples in groups.items():
        p = ref[key].double()
        n_g = len(samples)
        counts = torch.zeros_like(p)
        for tok, c in Counter(samples).items():
            counts[tok] += c
        dev += float((counts - n_g * p).abs().sum())
        mean_bound += float((n_g * p * (1 - p)).sqrt().sum())
    return dev / (2 * total), mean_bound / (2 * total) + math.sqrt(math.log(1 / DELTA) / (2 * total))


def assert_distributed(groups: dict, ref: dict, what: str) -> None:
    d, bound = grouped_tv(groups, ref)
    assert d < bound, f"{what}: TV {d:.4f} >= bound {bound:.4f} ({sum(map(len, groups.values()))} samples)"


# --------------------------------------------------------------------------------------------------
# 1. temperature -> top-k -> top-p equals transformers' logits warpers
# --------------------------------------------------------------------------------------------------

def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] -> [B, V] with transformers' own warpers, in the order `generate` applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1)


LOGIT_CASES = {
    "normal": lambda g: torch.randn(4, 50, generator=g) * 2,
    "peaked": lambda g: torch.randn(4, 50, generator=g) * 8,
    "ties": lambda g: torch.randint(-3, 3, (4, 50), generator=g).float(),  # ties at the top-k / top-p cut
    "small_vocab": lambda g: torch.randn(3, 4, generator=g),  # top_k 5 > V
}


@pytest.mark.parametrize("candidates", [64, 1])  # 1: every top-p cut found through the histogram
@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("case", sorted(LOGIT_CASES))
def test_probs_from_logits_matches_transformers(case, temperature, top_k, top_p, candidates, monkeypatch):
    from moechat.engine.speculative import sampling

    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
    for seed in range(3):
        logits = LOGIT_CASES[case](torch.Generator().manual_seed(seed))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        expected = hf_probs(logits, temperature, top_k, top_p)
        got = probs_from_logits(logits, params)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        if case == "ties" and top_p < 1.0:
            assert_equal_but_at_the_cut(logits, expected, got, temperature, top_k, top_p)
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        # the engine also calls it on single rows (prefill, drafters): same answer row by row
        for i in range(logits.shape[0]):
            torch.testing.assert_close(probs_from_logits(logits[i], params), got[i], rtol=0, atol=1e-6)
        # and on a batch of positions [n+1, V] with a leading dimension (verification)
        torch.testing.assert_close(probs_from_logits(logits[None], params)[0], got, rtol=0, atol=1e-6)


CUT_TOLERANCE = 5e-4  # mass: float32 softmax sums over 151 936 tokens differ by ~1.5e-4 with their order


def assert_equal_but_at_the_cut(logits: torch.Tensor, expected: torch.Tensor, got: torch.Tensor, temperature: float,
                                top_k: int, top_p: float) -> None:
    """got equals transformers' `expected` [R, V] but for tokens on top-p's cut: those tied with it (transformers' unstable
    sort picks which of them stay; moechat keeps the lowest ids) and, on a real vocabulary, a token whose mass below
    sits within float32 rounding of 1 - top_p. Every differing token must be such a one, checked in float64."""
    base = hf_probs(logits.double(), temperature, top_k, 1.0)  # [R, V] before top-p, exact enough to judge the cut
    scaled = logits.double() / temperature
    for r in range(logits.shape[0]):
        kept_got, kept_hf = got[r] > 0, expected[r] > 0
        for t in (kept_got != kept_hf).nonzero().flatten().tolist():
            below = float(base[r][scaled[r] < scaled[r, t]].sum())
            tied = float(base[r][scaled[r] == scaled[r, t]].sum())
            assert below - CUT_TOLERANCE <= 1 - top_p <= below + tied + CUT_TOLERANCE, (
                f"row {r}: token {t} differs but is not on the cut (mass below {below:.6f}, tied {tied:.6f})")
        common = kept_got & kept_hf
        torch.testing.assert_close(got[r][common] / got[r][common].sum(), expected[r][common] / expected[r][common].sum(),
                                   rtol=0, atol=1e-6)


def test_probs_from_logits_filters_what_it_should():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    top2 = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and top2[:2].sum().item() == pytest.approx(1.0)
    assert top2[0] / top2[1] == pytest.approx(math.e)
    # top-p keeps the smallest head whose mass reaches top_p; the top token always stays
    soft = logits.softmax(-1)
    keep = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=float(soft[0] + soft[1]) - 1e-4)) > 0
    assert keep.tolist() == [True, True, False, False, False]
    only_top = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert only_top.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # bf16 logits come back as float32 distributions
    assert probs_from_logits(logits.bfloat16(), SamplingParams(temperature=0.5)).dtype == torch.float32


@pytest.mark.parametrize("scale, top_p, nucleus", [(8.0, 0.9, (1, 64)), (2.0, 0.5, (64, 512)), (2.0, 0.9, (4096, 32768)),
                                                   (0.05, 0.95, (100000, 151936))])
def test_top_p_on_a_real_vocabulary_matches_transformers(scale, top_p, nucleus):
    """Qwen3's 151 936 tokens: a peaked row (a nucleus of a few tokens), spread ones (hundreds and thousands: the
    candidates grow past the first 64, 512 and 4096) and a nearly flat one, in bf16 as a model computes them."""
    for seed in range(4):
        logits = (torch.randn(3, 151936, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
        expected = hf_probs(logits.float(), 0.7, 0, top_p)
        got = probs_from_logits(logits, SamplingParams(temperature=0.7, top_p=top_p))
        assert_equal_but_at_the_cut(logits.float(), expected, got, 0.7, 0, top_p)
    kept = (got > 0).sum(-1)
    assert nucleus[0] <= kept.min() and kept.max() < nucleus[1]


def test_top_p_keeps_the_lowest_ids_of_a_tie_on_the_cut():
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])  # three tied tokens of 0.3 each; 0.55 needs two of them
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.55))
    assert (got > 0).tolist() == [False, True, True, False, False]


@pytest.mark.parametrize("row, top_p", [
    (torch.zeros(151936), 1e-7),  # 64 candidates all tied with the top: none above the 64th
    (torch.zeros(65), 1e-9),
    (torch.randint(0, 4, (5000,), generator=torch.Generator().manual_seed(0)).float(), 1e-6),
    (torch.cat((torch.full((100,), 1.0), torch.zeros(151836))), 1e-5),  # two levels
])
def test_top_p_on_rows_tied_past_the_candidates(row, top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got = probs_from_logits(row, params)
    assert_equal_but_at_the_cut(row[None], hf_probs(row[None], 1.0, 0, top_p), got[None], 1.0, 0, top_p)
    assert int((got > 0).sum()) == 1 and int(got.argmax()) == int((row == row.max()).nonzero()[0])  # the tie's lowest id


def test_top_p_at_a_temperature_near_zero():
    """Logits / 1e-16 reach 1e16, where hi - 1 rounds to hi: the histogram has no span (it divided by zero)."""
    row = torch.cat((torch.full((100,), 1.0), torch.zeros(1000)))
    got = probs_from_logits(row, SamplingParams(temperature=1e-16, top_p=0.9))
    assert torch.isfinite(got).all() and float(got.sum()) == pytest.approx(1.0) and int((got > 0).sum()) == 90


@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324])
def test_a_temperature_below_float32s_range_is_the_top_token(temperature):
    """A T that rounds to 0 in float32 divided the top logit 0 by 0: a NaN said as broken weights (an HTTP 500)."""
    row = torch.tensor([0.5, 2.0, 1.0, 2.0])
    got = probs_from_logits(row, SamplingParams(temperature=temperature))
    assert torch.equal(got, torch.tensor([0.0, 0.5, 0.0, 0.5]))  # the limit as T -> 0: the tied top tokens


@pytest.mark.parametrize("probs", [torch.tensor([0.5, float("nan"), 0.5]), torch.zeros(5),
                                   torch.tensor([float("inf"), 0.0])])
def test_sample_refuses_what_is_not_a_distribution(probs):
    """torch.multinomial raised on these; a draft of NaN must not be drawn (its ratio p/q would accept it always)."""
    from moechat.engine.errors import NumericsError

    with pytest.raises(NumericsError, match="NaN or infinite"):
        sample(probs, torch.Generator().manual_seed(0))


def test_sample_follows_the_distribution_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    tokens = [sample(probs, g) for _ in range(20000)]
    assert set(tokens) == {1, 3, 4}
    assert_distributed({0: tokens}, {0: probs}, "inverse-cdf sampling")
    again = torch.Generator().manual_seed(0)
    assert [sample(probs, again) for _ in range(50)] == tokens[:50]  # a seed replays


def test_sample_where_the_draw_rounds_up_to_the_total(monkeypatch):
    """u * total can round up to the total itself: the last token of nonzero probability, not one past the end."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert sample(torch.tensor([0.25, 0.75, 0.0, 0.0]), torch.Generator()) == 1


# --------------------------------------------------------------------------------------------------
# 2. greedy acceptance
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "drafts, target_argmax, expected",
    [
        ([4, 8, 15, 16], [4, 8, 15, 16, 23], (4, 23)),  # all accepted: n and the bonus token
        ([4, 8, 15, 16], [9, 8, 15, 16, 23], (0, 9)),  # first rejected: the target's correction
        ([4, 8, 15, 16], [4, 8, 7, 16, 23], (2, 7)),  # middle rejected; later matches do not count
        ([4, 8, 15, 16], [4, 8, 15, 42, 23], (3, 42)),  # last rejected
        ([], [11], (0, 11)),  # n = 0: just the target's next token
        ([5], [5, 6], (1, 6)),
    ],
)
def test_accept_greedy(drafts, target_argmax, expected):
    assert accept_greedy(drafts, target_argmax) == expected


# --------------------------------------------------------------------------------------------------
# 3. rejection sampling emits tokens distributed as the target's, whatever the draft
# --------------------------------------------------------------------------------------------------

V = 6


def random_dists(rows: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * scale, dim=-1)


def draw_emitted(q: torch.Tensor, p: torch.Tensor, draws: int, seed: int, rule=accept_sampling) -> list[tuple[int, list[int]]]:
    """Repeat one speculative step: drafts d_i ~ q_i, then `rule`; returns (a, emitted tokens) per draw."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        drafts = torch.multinomial(q, 1, generator=g).flatten().tolist()
        a, t = rule(drafts, q, p, g)
        assert 0 <= a <= len(drafts) and 0 <= t < V
        out.append((a, drafts[:a] + [t]))
    return out


def emitted_groups(results, n: int) -> tuple[dict, dict]:
    """Position k of the emitted tokens exists iff a >= k; given that, it must be distributed as p[k].
    (The draft d_k and its coin are independent of what decided the earlier positions.)"""
    groups = {k: [e[k] for _, e in results if len(e) > k] for k in range(n + 1)}
    return {k: s for k, s in groups.items() if s}, groups


def check_lossless(q: torch.Tensor, p: torch.Tensor, results, what: str) -> None:
    n = q.shape[0]
    groups, _ = emitted_groups(results, n)
    # FIRST emitted token (d0 if a >= 1 else the correction t): exactly p[0], over all draws
    assert_distributed({0: groups[0]}, {0: p[0]}, f"{what}: first emitted token")
    # SECOND emitted token given that the first was an accepted draft: p[1]
    if 1 in groups:
        assert len(groups[1]) > 1000
        assert_distributed({1: groups[1]}, {1: p[1]}, f"{what}: second emitted token given d0 accepted")
    # every position at once (later positions have fewer samples; the bound adapts)
    assert_distributed(groups, {k: p[k] for k in groups}, f"{what}: all positions")


def test_accept_sampling_is_lossless():
    n = 3
    p, q = random_dists(n + 1, seed=1), random_dists(n, seed=2)
    assert 0.5 * (p[:n] - q).abs().sum(-1).min() > 0.2  # the draft really differs from the target
    results = draw_emitted(q, p, 20000, seed=3)
    accepts = Counter(a for a, _ in results)
    assert accepts[0] > 1000 and accepts[n] > 200  # both rejection and full acceptance happen
    # P(d0 accepted) = sum_j min(p0_j, q0_j) = 1 - TV(p0, q0)
    rate = sum(a >= 1 for a, _ in results) / len(results)
    assert rate == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.02)
    check_lossless(q, p, results, "random q")


def test_accept_sampling_draft_equals_target_accepts_everything():
    n = 4
    p = random_dists(n + 1, seed=4)
    q = p[:n].clone()
    results = draw_emitted(q, p, 10000, seed=5)
    assert all(a == n for a, _ in results)  # ratio p/q == 1 exactly: never rejected
    assert_distributed({0: [e[n] for _, e in results]}, {0: p[n]}, "bonus token")
    check_lossless(q, p, results, "q == p")


def test_accept_sampling_draft_without_mass_where_target_has_it():
    n = 2
    p = random_dists(n + 1, seed=6)
    q = random_dists(n, seed=7)
    # the draft never proposes tokens 0 and 1, which the target likes ...
    p[:, :2] += 1.0
    q[:, :2] = 0.0
    # ... and proposes token 5, which the target excludes (as a top-k cut would)
    p[:, 5] = 0.0
    q[:, 5] += 1.0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    results = draw_emitted(q, p, 20000, seed=8)
    assert all(5 not in e for _, e in results)  # p(5) = 0: a draft of 5 is always rejected
    emitted = Counter(e[0] for _, e in results)
    assert emitted[0] > 0 and emitted[1] > 0  # recovered from the residual only
    check_lossless(q, p, results, "q without mass on p's tokens")


def test_accept_sampling_without_drafts():
    p = random_dists(1, seed=9)
    g = torch.Generator().manual_seed(0)
    tokens = []
    for _ in range(5000):
        a, t = accept_sampling([], torch.empty(0, V), p, g)
        assert a == 0
        tokens.append(t)
    assert_distributed({0: tokens}, {0: p[0]}, "n = 0")


def _always_accept(drafts, q, p, generator):
    return len(drafts), sample(p[len(drafts)], generator)


def _resample_from_target(drafts, q, p, generator):
    """A classic mistake: at a rejection draw from p instead of the residual norm(max(0, p - q))."""
    for i, d in enumerate(drafts):
        if float(torch.rand(1, generator=generator)) >= float(p[i, d] / q[i, d]):
            return i, sample(p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


@pytest.mark.parametrize("rule", [_always_accept, _resample_from_target])
def test_distribution_check_catches_wrong_rules(rule):
    """The TV check above has power: wrong acceptance rules fail it at the same sample size."""
    n = 3
    p, q = random_dists(n + 1, seed=1), random_dists(n, seed=2)
    results = draw_emitted(q, p, 20000, seed=3, rule=rule)
    with pytest.raises(AssertionError, match="TV"):
        check_lossless(q, p, results, rule.__name__)


# --------------------------------------------------------------------------------------------------
# 4. end to end: the engine's sampled tokens follow the target model's distribution
# --------------------------------------------------------------------------------------------------

PROMPT_IDS = [5, 17, 42, 99, 123]
TOP_K = 8
DRAFT_LEN = 4
RUNS = 2000


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    tok = tmp_path_factory.mktemp("sampling-tokenizer")
    tiny.build_tokenizer(tok)
    return tiny.make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("sampling-qwen3_moe"), tok, seed=0)


def target_dist(model, ids: list[int]) -> torch.Tensor:
    """The target's exact next-token distribution after `ids`, with transformers' own warpers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[:, -1].float()  # [1, V]
    return hf_probs(logits, 1.0, TOP_K, 1.0)[0]


def sample_engine(model_dir: Path, runs: int, expert_cache_ratio: float = 0.5, policy: str = "lru"):
    """`runs` independent requests (seed = run index) on one engine; per run: (first, second, accepted in step 1)."""
    engine = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=expert_cache_ratio,
                                 scheduler=SchedulerConfig(policy), spec=SpecConfig(drafter="self", draft_len=DRAFT_LEN)))
    # max_new_tokens = 1 (prefill) + DRAFT_LEN + 1 (bonus): the first decoding step drafts the full
    # DRAFT_LEN tokens (with max_new_tokens = 2 the engine would draft none: n = max_new - len(new) - 1 = 0).
    max_new = DRAFT_LEN + 2
    out = []
    for seed in range(runs):
        params = SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=max_new, seed=seed)
        events = list(engine.generate(Request(token_ids=PROMPT_IDS), params))
        fin = events[-1]
        assert isinstance(fin, Finished), fin
        assert len(fin.token_ids) == max_new and fin.summary.finish_reason == "length"
        step1 = next(e for e in events if isinstance(e, StepStats))
        assert step1.step == 1 and step1.drafted == DRAFT_LEN
        out.append((fin.token_ids[0], fin.token_ids[1], step1.accepted))
    return out


def test_engine_sampling_matches_target_distribution(qwen3_dir):
    """Self-drafting with half the experts resident, sampled (temperature 1, top-k 8).

    The first token comes from the prefill; the second is the first token of the first speculative
    step: an accepted self-draft or the residual correction. Its exact distribution depends on the
    first token, so instead of conditioning on the most frequent first token alone (~1/6 of the runs),
    every run is used: the exact target distribution p(. | prompt + first) is computed with
    transformers for each first token seen (at most top-k = 8 of them), and the statistic is
    D = sum_f (n_f / N) TV(empirical second tokens after f, p(. | prompt + f)).
    Given the first tokens the second tokens are independent with those distributions, whatever the
    expert-cache state left by earlier runs (which only changes the drafts q, not the target p), so
    `grouped_tv`'s bound applies: E[D] <= (1/2N) sum_f sum_j sqrt(n_f p_fj (1 - p_fj)) (about 0.083
    here) plus the McDiarmid margin sqrt(ln(1/DELTA) / 2N) (0.048 for N = 2000, DELTA = 1e-4): a
    bound of about 0.13, where the correct engine measures D = 0.063. Measured with monkeypatched
    wrong rules in the engine: always accepting the drafts (emitting the self-drafter's q) gives
    D = 0.27, drawing the correction from p instead of the residual D = 0.15, verifying against the
    target's distributions shifted by one position D = 0.71; all fail. The draft must differ from the
    target for this to mean anything: the checks on the step-1 rejections below make sure it does.
    """
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threading only adds overhead (and contention)
    try:
        runs = sample_engine(qwen3_dir, RUNS)
        model = AutoModelForCausalLM.from_pretrained(qwen3_dir).eval()
        p_first = target_dist(model, PROMPT_IDS)
        firsts = [f for f, _, _ in runs]
        p_second = {f: target_dist(model, PROMPT_IDS + [f]) for f in set(firsts)}
    finally:
        torch.set_num_threads(threads)

    # the first token (prefill) follows the target's distribution
    assert set(firsts) <= set(p_first.nonzero().flatten().tolist())
    assert_distributed({0: firsts}, {0: p_first}, "first token")

    # speculation really happened with a draft that differs from the target: the first draft is
    # rejected with probability TV(p, q), and whole drafts are accepted too
    accepted = Counter(a for _, _, a in runs)
    assert accepted[0] / RUNS > 0.1, accepted
    assert sum(c for a, c in accepted.items() if a >= 1) / RUNS > 0.3, accepted

    # the second token (through rejection sampling) follows p(. | prompt + first)
    groups: dict[int, list[int]] = {}
    for f, s, _ in runs:
        groups.setdefault(f, []).append(s)
    for f, seconds in groups.items():
        assert set(seconds) <= set(p_second[f].nonzero().flatten().tolist()), f"outside top-{TOP_K} after {f}"
    assert_distributed(groups, p_second, "second token given the first")
    # the most frequent first token alone, as a sanity check with its own (looser) bound
    top = max(groups, key=lambda f: len(groups[f]))
    assert_distributed({top: groups[top]}, {top: p_second[top]}, f"second token after {top}")


def assert_warped(logits: torch.Tensor, got: torch.Tensor, temperature: float, top_k: int, top_p: float) -> None:
    """got [R, V] is transformers' warped distribution of logits [R, V] (top-p's cut aside, see above)."""
    expected = hf_probs(logits, temperature, top_k, top_p)
    if top_p < 1.0:
        assert_equal_but_at_the_cut(logits, expected, got, temperature, top_k, top_p)
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("drafter", ["model", "self"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.0, 3, 1.0), (1.5, 5, 0.8)])
def test_the_rule_gets_the_warped_distributions_of_each_drafted_position(checkpoint, draft_dir, drafter, temperature,
                                                                         top_k, top_p, monkeypatch):
    """What the engine hands the rejection rule (whose losslessness the tests above check): per drafted position the
    target's distribution p and the drafter's q, each with the request's temperature, top-k and top-p, after the same
    prefix, and drafts q can draw; computed again with transformers' models and warpers. The self drafter runs with every
    expert on its fast tier, so its q is the target's. A q or p left unwarped, or a row one position off, fails here;
    the end-to-end distribution test above samples only top-k, and only with the self drafter."""
    from transformers import AutoModelForCausalLM

    from moechat.engine.speculative import verify

    calls, rule = [], verify.accept_sampling

    def spy(drafts, q, p, generator):
        a, t = rule(drafts, q, p, generator)
        calls.append((list(drafts), q, p, a, t))
        return a, t

    monkeypatch.setattr(verify, "accept_sampling", spy)
    target_dir = checkpoint("qwen3_moe")
    engine = Engine(EngineConfig(model_dir=str(target_dir), expert_cache_ratio=1.0, conversation_cache_bytes=0,
                                 spec=SpecConfig(drafter=str(draft_dir) if drafter == "model" else drafter, draft_len=3)))
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval() if drafter == "model" else target
    drafted = 0
    for seed in range(3):
        calls.clear()
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=12)
        fin = list(engine.generate(Request(token_ids=PROMPT_IDS), params))[-1]
        assert isinstance(fin, Finished), fin
        committed = list(PROMPT_IDS)
        for drafts, q, p, a, t in calls:
            n, ids = len(drafts), torch.tensor([committed + drafts])
            with torch.no_grad():  # rows i: the distributions after committed + drafts[:i]
                assert_warped(target(ids).logits[0, len(committed) - 1:].float(), p, temperature, top_k, top_p)
                if n:
                    assert_warped(draft(ids).logits[0, len(committed) - 1:-1].float(), q, temperature, top_k, top_p)
                    assert all(float(q[i, d]) > 0 for i, d in enumerate(drafts))  # each draft is one q could draw
            drafted += n
            committed += drafts[:a] + [t]
        assert committed[len(PROMPT_IDS):][:len(fin.token_ids)] == fin.token_ids  # the calls replayed the reply
    assert drafted > 0


def test_accept_sampling_rejects_a_draft_that_neither_distribution_allows():
    """p(d) = q(d) = 0 gave a ratio of 0/0 = NaN, and `u >= NaN` is False: the draft was kept, a token p forbids."""
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    for seed in range(20):
        a, t = accept_sampling([2], q, p, torch.Generator().manual_seed(seed))
        assert a == 0 and t in (0, 1)


# --------------------------------------------------------------------------------------------------
# On a GPU: the warpers run on the logits' device, the draws on the host's seeded generator
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("scale, temperature, top_k, top_p", [(8.0, 0.7, 0, 0.9), (2.0, 0.7, 0, 0.9), (0.05, 0.7, 0, 0.95),
                                                               (2.0, 1.3, 50, 0.8), (2.0, 0.7, 40, 1.0)])
def test_the_warpers_on_a_gpu_keep_what_transformers_keeps(scale, temperature, top_k, top_p):
    """Top-p on CUDA (its candidates, the histogram's index_add_ and searchsorted, the cut's sorts), top-k and the
    temperature on a real vocabulary in bf16, as the target's and a draft model's logits come: transformers' warpers'
    distribution, on the device, and a token drawn from it with the request's CPU generator."""
    for seed in range(2):
        logits = (torch.randn(3, 151936, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16().cuda()
        got = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        assert got.device == logits.device and got.dtype == torch.float32 and torch.isfinite(got).all()
        assert_warped(logits.float().cpu(), got.cpu(), temperature, top_k, top_p)
        token = sample(got[0], torch.Generator().manual_seed(seed))
        assert float(got[0, token]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["none", "self", "model"])
def test_a_seed_repeats_a_sampled_reply_on_a_gpu(drafter, checkpoint, draft_dir, monkeypatch):
    """Sampled decoding on CUDA with temperature, top-k and top-p, each drafter (the self drafter with half the experts
    on the GPU): the drafts' q and the target's p reach the rejection rule on the host, where the request's generator
    draws, and the same seed gives the same reply from the same start."""
    from moechat.engine.speculative import verify

    seen, rule = [], verify.accept_sampling

    def spy(drafts, q, p, generator):
        seen.append((p.device.type, None if q is None else q.device.type))
        return rule(drafts, q, p, generator)

    monkeypatch.setattr(verify, "accept_sampling", spy)
    config = EngineConfig(model_dir=str(checkpoint("qwen3_moe")), device="cuda", expert_cache_ratio=0.5,
                          spec=SpecConfig(drafter=str(draft_dir) if drafter == "model" else drafter, draft_len=3))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_tokens=12)
    replies = []
    for _ in range(2):  # each from the same start: the fast tier's contents, which the self drafter drafts with, too
        engine = Engine(config)
        replies.append(list(engine.generate(Request(token_ids=PROMPT_IDS), params))[-1])
        engine.close()
    assert all(isinstance(fin, Finished) for fin in replies), replies
    assert replies[0].token_ids == replies[1].token_ids and len(replies[0].token_ids) > 0
    assert seen and all(p == "cpu" and q in (None, "cpu") for p, q in seen)
    if drafter != "none":
        assert any(q == "cpu" for _, q in seen)  # drafts were sampled and judged
