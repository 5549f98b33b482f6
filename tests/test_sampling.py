"""Lossless sampling with copy drafts: the accelerated sampler's output distribution equals
the model's own sampling distribution, for drafts that are always right, always wrong or mixed.

Statistical test: the first two sampled tokens of N seeded runs against the exact joint
distribution computed from the model (chi-square goodness of fit, cells with expected
count < 5 pooled). Each test fails by chance with probability ALPHA = 1e-3 over the choice
of seeds; with the fixed seeds here the outcome is deterministic."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_model, trained_bpe_tokenizer

from rag_accel import DecoderConfig, Draft, ReferenceDecoder
from rag_accel.hf.draft_models import ModelDrafter as DraftModel
from rag_accel.hf.draft_models import UniversalDrafter
from rag_accel.hf.sampling import GumbelNoise, Sampling, gumbel_argmax, probabilities

scipy_stats = pytest.importorskip("scipy.stats")

N, ALPHA = 2000, 1e-3
SETTINGS = dict(temperature=2.0, top_k=8)  # a spread-out but finite support: <= 64 cells for two tokens


@pytest.fixture(scope="module")
def tokenizer():
    """A 600-token BPE trained here: each sampled run costs a quarter of what the default model's 49,152-token
    vocabulary costs (the head and the Gumbel noise are per vocabulary entry), and N runs per mode add up."""
    from rag_accel.rag.msmarco import load_msmarco_sample

    return trained_bpe_tokenizer([p for it in load_msmarco_sample(limit=20) for p in it.passages], vocab_size=600)


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = tiny_model("llama", len(tokenizer), seed=5)
    with torch.no_grad():  # a random init is nearly uniform over the top k; sharpen it so the test has power
        model.lm_head.weight.mul_(100)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=4))
    prompt = tokenizer("The quick brown fox")["input_ids"]
    return model, dec, prompt


def _dist(model, ids, warpers):
    with torch.inference_mode():
        return probabilities(model(torch.tensor([ids])).logits[0, -1:], warpers)[0]


def exact_joint(model, prompt, sampling):
    """P(t1, t2) for the first two sampled tokens, over the (top-k) support."""
    w = sampling.warpers()
    p1 = _dist(model, prompt, w)
    out = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = _dist(model, prompt + [t1], w)
        for t2 in torch.nonzero(p2).flatten().tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


class ModelDrafter:
    """Drafts from the model itself: 'right' = its most likely continuation (often accepted),
    'wrong' = a token outside the top-k support (probability 0: always rejected),
    'mix' = random tokens from the support or outside it."""

    name = "oracle"

    def __init__(self, model, mode, seed=0):
        self.model, self.mode, self.rng = model, mode, random.Random(seed)

    def _logits(self, ids):
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0, -1]

    def propose(self, context, max_len):
        ids, draft = list(context), []
        for _ in range(max_len):
            logits = self._logits(ids)
            if self.mode == "right" or (self.mode == "mix" and self.rng.random() < 0.5):
                tok = int(logits.argmax())
            elif self.mode == "wrong":
                tok = int(logits.argmin())
            else:
                tok = int(torch.topk(logits, 16).indices[self.rng.randrange(16)])  # half of these are off-support
            draft.append(tok)
            ids.append(tok)
        return Draft(draft, 1, self.name)

    def update(self, context, num_new):
        pass


def sample_counts(dec, prompt, drafters_for):
    counts = {}
    for i in range(N):
        out = dec.generate(prompt, max_new_tokens=3, do_sample=True, seed=i, drafters=drafters_for(i), **SETTINGS)
        key = tuple(out.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p(counts, joint):
    assert set(counts) <= set(joint), "sampled a pair outside the support"
    keys = sorted(joint, key=joint.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = joint[k] * N
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = sum(obs) / sum(exp)  # joint sums to 1 up to float error
    return scipy_stats.chisquare(obs, [e * scale for e in exp]).pvalue


@pytest.fixture(scope="module")
def joint(setup):
    model, dec, prompt = setup
    return exact_joint(model, prompt, Sampling(**SETTINGS))


@pytest.fixture(scope="module")
def other_model(tokenizer):
    """A draft model of the same vocabulary that disagrees with the target (another random init)."""
    model = tiny_model("llama", len(tokenizer), seed=6)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    return model


@pytest.fixture(scope="module")
def universal(tokenizer):
    """A draft model with another vocabulary (a BPE trained here) and its tokenizer."""
    from rag_accel.rag.msmarco import load_msmarco_sample

    bpe = trained_bpe_tokenizer([p for it in load_msmarco_sample(limit=20) for p in it.passages], vocab_size=500)
    return tiny_model("llama", len(bpe), seed=7), bpe, tokenizer


def _drafters(mode, model, other_model, i, universal=None):
    if mode == "none":
        return []
    if mode == "draft-model-same":  # q = p: the coupled draft token is always the sampled one
        return [DraftModel(model, confidence=0.0)]
    if mode == "draft-model-other":
        return [DraftModel(other_model, confidence=0.0)]
    if mode == "draft-model-universal":  # another vocabulary: greedy point-mass drafts
        return [UniversalDrafter(*universal, confidence=0.0)]
    return [ModelDrafter(model, mode, seed=i)]


@pytest.mark.parametrize("mode", ["none", "right", "wrong", "mix", "draft-model-same", "draft-model-other",
                                  "draft-model-universal"])
def test_sampled_distribution_equals_the_models(setup, joint, other_model, universal, mode):
    model, dec, prompt = setup
    counts = sample_counts(dec, prompt, lambda i: _drafters(mode, model, other_model, i, universal))
    assert chi_square_p(counts, joint) > ALPHA


def test_a_draft_model_of_the_same_distribution_is_always_accepted(setup, other_model):
    """Coupled speculative sampling: a draft model equal to the target proposes exactly the tokens the
    target samples; an unrelated one rarely does."""
    model, dec, prompt = setup
    same = dec.generate(prompt, max_new_tokens=24, do_sample=True, seed=3, drafters=[DraftModel(model, confidence=0.0)],
                        **SETTINGS).stats
    assert same.accepted == same.drafted > 0
    other = dec.generate(prompt, max_new_tokens=24, do_sample=True, seed=3,
                         drafters=[DraftModel(other_model, confidence=0.0)], **SETTINGS).stats
    assert other.accepted < other.drafted / 2


def test_the_check_has_power(setup, joint):
    """The same counts tested against a nearby wrong distribution (temperature 1.6 instead of 2) fail."""
    model, dec, prompt = setup
    counts = sample_counts(dec, prompt, lambda i: [ModelDrafter(model, "mix", seed=i)])
    wrong = exact_joint(model, prompt, Sampling(temperature=1.6, top_k=8))
    assert set(counts) <= set(wrong)
    assert chi_square_p(counts, wrong) < 1e-6


def test_right_drafts_are_accepted_and_seeded_runs_repeat(setup):
    model, dec, prompt = setup
    outs = [dec.generate(prompt, max_new_tokens=24, do_sample=True, seed=7, drafters=[ModelDrafter(model, "right")],
                         **SETTINGS) for _ in range(2)]
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 24
    assert outs[0].stats.accepted > 0
    plain = [dec.generate(prompt, max_new_tokens=24, do_sample=True, seed=s, **SETTINGS).token_ids for s in (1, 2)]
    assert plain[0] != plain[1]  # different seeds, different samples (at temperature 2 over 24 tokens)


def _gumbel_samples(scores, n, seed=0):
    noise = GumbelNoise(scores.shape[-1], seed)
    return gumbel_argmax(scores.expand(n, -1), noise.rows(0, n)).tolist()


def test_verification_has_the_point_mass_laws():
    """Against the sampled tokens, a draft token d is accepted with probability p(d); after a
    rejection the token follows p without d, renormalised."""
    toks = _gumbel_samples(torch.tensor([[0.5, 0.3, 0.2]]).log(), 6000)
    accepted = sum(t == 0 for t in toks)  # draft d = 0
    assert 2800 < accepted < 3200  # p(0) = 0.5, 6 sigma ~ 230
    rejected = [t for t in toks if t != 0]
    assert 0.53 < sum(t == 1 for t in rejected) / len(rejected) < 0.67  # 0.3 / 0.5 = 0.6


def test_coupled_draft_model_tokens_agree_as_the_bound_says():
    """A draft model drawing with the same noise: its token follows q, and agrees with the model's
    token with probability >= (1 - TV) / (1 + TV) (here 0.82; the accept/resample rule: 1 - TV = 0.9)."""
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.4, 0.4, 0.2]])
    n = 6000
    noise = GumbelNoise(3, 3).rows(0, n)
    tp = gumbel_argmax(p.log().expand(n, -1), noise)
    tq = gumbel_argmax(q.log().expand(n, -1), noise)
    assert abs(float((tq == 1).float().mean()) - 0.4) < 0.04  # the draft token is distributed as q
    agree = float((tp == tq).float().mean())
    assert agree > 0.818 - 0.03  # 6 sigma below the bound
    wrong_noise = GumbelNoise(3, 4).rows(0, n)  # independent noise: agreement only sum p*q = 0.36
    assert float((gumbel_argmax(q.log().expand(n, -1), wrong_noise) == tp).float().mean()) < 0.45


def test_noise_is_seeded_by_position():
    a, b = GumbelNoise(50, 9), GumbelNoise(50, 9)
    first = a.rows(0, 3)
    assert torch.equal(first[1:], b.rows(1, 3))  # same seed, same row per position, whatever the order asked
    assert torch.equal(a.rows(2, 5)[0], first[2])
    a.forget_before(3)
    with pytest.raises(ValueError, match="forgotten"):
        a.rows(1, 2)


def test_seeded_output_does_not_depend_on_the_drafts(setup):
    model, dec, prompt = setup
    other = tiny_model("llama", dec.vocab_size, seed=8)
    outs = {mode: dec.generate(prompt, max_new_tokens=16, do_sample=True, seed=21, **SETTINGS,
                               drafters=_drafters(mode, model, other, 2)).token_ids
            for mode in ("none", "right", "wrong", "mix", "draft-model-same", "draft-model-other")}
    assert len(set(map(tuple, outs.values()))) == 1


def test_sampling_arguments_are_checked(setup):
    model, dec, prompt = setup
    with pytest.raises(ValueError, match="do_sample=True"):
        dec.generate(prompt, max_new_tokens=2, temperature=0.7)
    for bad in (dict(temperature=0), dict(top_k=0), dict(top_p=1.5), dict(seed="x")):
        with pytest.raises(ValueError):
            dec.generate(prompt, max_new_tokens=2, do_sample=True, **bad)
