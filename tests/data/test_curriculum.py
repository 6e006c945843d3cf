"""Prompt curricula: uniform and ordered epochs, pass-rate sampling, the lag rule, resume."""

import io

import numpy as np
import pytest

from jaxrl.data.curriculum import LAG, PassRateSampler, make_prompt_sampler
from jaxrl.data.pass_rate import PassRateConfig, pass_rate_weight

N, B, G, SEED = 12, 4, 4, 3
DIFFICULTY_N = np.array([2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1], float)


def np_round_trip(state):
    buffer = io.BytesIO()
    np.savez(buffer, **state)
    buffer.seek(0)
    with np.load(buffer) as loaded:
        return dict(loaded)


def success_of(step, positions_B):
    """A made-up but fixed success per (step, prompt): prompt i passes with rate i / N."""
    rng = np.random.default_rng((99, step))
    return (rng.random(len(positions_B)) < positions_B / N).astype(float)


def sampler(kind, **kw):
    difficulty = DIFFICULTY_N if kind == "ordered" else None
    return make_prompt_sampler(kind, N, B, SEED, difficulty_N=difficulty, group_size=G, **kw)


class Loop:
    """Drives a sampler as the training loop does: draws, and observes every step either
    right after its draw (early) or only just before the draw that needs it (late)."""

    def __init__(self, s, success=success_of, drawn=None, observed=None):
        self.s, self.success = s, success
        self.drawn, self.observed = dict(drawn or {}), set(observed or ())

    def observe(self, step):
        self.s.observe(step, self.drawn[step], self.success(step, self.drawn[step]))
        self.observed.add(step)

    def draw(self, steps, *, late=False):
        start = self.s.step
        for step in range(start, start + steps):
            if step >= LAG and step - LAG not in self.observed:
                self.observe(step - LAG)
            self.drawn[step] = self.s.draw()
            if not late:
                self.observe(step)
        return [self.drawn[step].tolist() for step in range(start, start + steps)]


def test_uniform_epochs_are_the_seeded_permutations():
    s = sampler("none")
    for epoch in range(3):
        order_N = np.random.default_rng((SEED, epoch)).permutation(N)
        for i in range(N // B):
            assert s.draw().tolist() == order_N[i * B:(i + 1) * B].tolist()
    assert s.step == 9 and s.metrics() == {"data/epoch": 3.0}


def test_ordered_epochs_go_easy_to_hard_with_seeded_ties():
    n, b = 13, 4  # one prompt of each epoch's order (a hardest one) is dropped
    s = make_prompt_sampler("ordered", n, b, SEED, difficulty_N=np.arange(n) % 3)
    epochs = []
    for epoch in range(3):
        visited = np.concatenate([s.draw() for _ in range(n // b)])
        rank_N = np.argsort(np.random.default_rng((SEED, epoch)).permutation(n))
        want = sorted(range(n), key=lambda i: (i % 3, rank_N[i]))[:12]
        assert visited.tolist() == want
        assert (np.diff(visited % 3) >= 0).all()
        epochs.append(visited.tolist())
    assert len({tuple(e) for e in epochs}) == 3  # ties are reshuffled every epoch


def test_pass_rate_weight_is_the_chance_a_group_disagrees():
    config = PassRateConfig(group_size=4, floor=0.05)
    pass_N = np.array([0.0, 1.0, 0.5, 0.25, 0.3])
    seen_N = np.array([True, True, True, True, False])
    want = [0.05, 0.05, 0.05 + 0.95 * (1 - 2 / 16), 0.05 + 0.95 * (1 - 0.25**4 - 0.75**4), 1]
    np.testing.assert_allclose(pass_rate_weight(pass_N, seen_N, config), want)


def test_pass_rate_prefers_prompts_that_still_give_a_learning_signal():
    n, b = 40, 4
    easy_N = np.arange(n) < n // 2  # always solved; the others are solved half the time
    loop = Loop(PassRateSampler(n, b, SEED, PassRateConfig(group_size=G, floor=0.05)),
                success=lambda step, positions_B: np.where(easy_N[positions_B], 1.0, 0.5))
    loop.draw(60)  # long enough for every prompt to be seen
    assert loop.s.metrics()["curriculum/seen_frac"] == 1.0
    picks = np.array(loop.draw(300))
    assert all(len(set(p)) == b for p in picks.tolist())  # never twice in a batch
    mid_frac = 1 - easy_N[picks].mean()
    # Each successive pick takes a mid prompt with probability at least
    # (M - b + 1) w_mid / ((M - b + 1) w_mid + E w_easy), M = E = 20 mid and easy prompts.
    w_easy, w_mid = pass_rate_weight(np.array([1.0, 0.5]), np.array([True, True]),
                                     loop.s.config)
    bound = 17 * w_mid / (17 * w_mid + 20 * w_easy)
    assert bound > 0.9
    assert bound - 0.03 < mid_frac < 1  # 0.03: over 3 standard deviations of 1200 picks
    assert loop.s.metrics()["curriculum/mean_pass_rate"] == pytest.approx(0.75)


def test_observations_apply_lag_steps_later_whenever_they_arrive():
    early = Loop(sampler("pass_rate")).draw(12)
    assert Loop(sampler("pass_rate")).draw(12, late=True) == early
    mixed = Loop(sampler("pass_rate"))  # early around a "checkpoint", late otherwise
    assert mixed.draw(5, late=True) + mixed.draw(2) + mixed.draw(5, late=True) == early
    assert len({tuple(p) for p in early}) > 6  # the draws vary with the observations
    s = sampler("pass_rate")
    s.observe(0, s.draw(), np.ones(B))
    s.draw()
    assert s.metrics()["curriculum/seen_frac"] == 0  # step 1's batch ignores step 0
    s.draw()
    assert s.metrics()["curriculum/seen_frac"] == B / N
    with pytest.raises(ValueError, match="the batch of step 3 needs the observation of step 1"):
        s.draw()


@pytest.mark.parametrize("kind", ["none", "ordered", "pass_rate"])
def test_state_restore_resumes_exactly_with_pending_observations(kind):
    reference = Loop(sampler(kind))
    reference.draw(7, late=True)  # steps 0..6, 0..4 observed
    reference.observe(5)  # early: the state carries it and step 6's draw, both pending
    state = np_round_trip(reference.s.state())
    resumed = Loop(sampler(kind), drawn=reference.drawn, observed=reference.observed)
    resumed.s.restore(state)
    assert resumed.s.step == 7
    assert resumed.draw(10, late=True) == reference.draw(10, late=True)
    assert resumed.s.metrics() == reference.s.metrics()


def test_restore_names_what_does_not_fit():
    state = sampler("pass_rate").state()
    with pytest.raises(ValueError, match="has curriculum='pass_rate' but this iterator has "
                                         "curriculum='ordered'"):
        sampler("ordered").restore(state)
    s = sampler("pass_rate")
    with pytest.raises(ValueError, match="missing key 'seen_N'"):
        s.restore({k: v for k, v in state.items() if k != "seen_N"})
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        s.restore(state | {"extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'pass_rate_N' must be a floating array of shape "
                                         r"\(12,\), got float64 \(11,\)"):
        s.restore(state | {"pass_rate_N": np.zeros(11)})
    with pytest.raises(ValueError, match=r"has num_prompts=13 but this iterator has "
                                         r"num_prompts=12"):
        s.restore(state | {"num_prompts": np.asarray(13)})
    with pytest.raises(ValueError, match=r"pass_rate_N has values outside \[0, 1\]"):
        s.restore(state | {"pass_rate_N": np.full(N, 2.0)})
    with pytest.raises(ValueError, match="recent_positions_LxB=.* does not fit step=0"):
        s.restore(state | {"recent_positions_LxB": np.zeros((LAG, B), np.int64)})


def test_factory_and_observe_errors_are_named():
    with pytest.raises(ValueError, match=r"unknown curriculum 'easy'; expected one of "
                                         r"\['none', 'pass_rate', 'ordered'\]"):
        make_prompt_sampler("easy", N, B, SEED)
    with pytest.raises(ValueError, match="'ordered' curriculum needs difficulty_N"):
        make_prompt_sampler("ordered", N, B, SEED)
    with pytest.raises(ValueError, match="difficulty_N is only used by the 'ordered'"):
        make_prompt_sampler("pass_rate", N, B, SEED, difficulty_N=DIFFICULTY_N)
    with pytest.raises(ValueError, match=r"3 non-finite values .* first at position 1: nan"):
        make_prompt_sampler("ordered", N, B, SEED,
                            difficulty_N=np.where(np.arange(N) % 5 == 1, np.nan, 0))
    with pytest.raises(ValueError, match=r"one value per usable prompt, shape \(12,\), got "
                                         r"\(11,\)"):
        make_prompt_sampler("ordered", N, B, SEED, difficulty_N=np.zeros(N - 1))
    with pytest.raises(ValueError, match="difficulty_N must hold numbers"):
        make_prompt_sampler("ordered", N, B, SEED, difficulty_N=["easy"] * N)
    with pytest.raises(ValueError, match="batch_size=13 must be between 1 and the 12"):
        make_prompt_sampler("none", N, 13, SEED)
    with pytest.raises(ValueError, match="group_size must be at least 1, got 0"):
        make_prompt_sampler("pass_rate", N, B, SEED, group_size=0)
    s = sampler("pass_rate")
    with pytest.raises(ValueError, match=r"observe\(step=0\): only steps 0..-1 have been drawn"):
        s.observe(0, np.arange(B), np.ones(B))
    positions_B = s.draw()
    with pytest.raises(ValueError, match="got positions .* but step 0 drew"):
        s.observe(0, positions_B[::-1], np.ones(B))
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        s.observe(0, positions_B, np.full(B, np.nan))
    s.observe(0, positions_B, np.ones(B))
    with pytest.raises(ValueError, match="step 0 was already observed"):
        s.observe(0, positions_B, np.ones(B))
    s.draw()
    s.draw()
    with pytest.raises(ValueError, match="comes too late: the batch of step 2"):
        s.observe(0, positions_B, np.ones(B))
    sampler("none").observe(5, None, None)  # ignored, unchecked: uniform does not learn


def test_a_longer_lag_draws_further_ahead_of_the_observations():
    # Async mode (max_staleness 2) draws each batch 2 steps earlier: lag LAG + 2.
    s = make_prompt_sampler("pass_rate", N, B, seed=0, group_size=4, lag=LAG + 2)
    s.observe(0, s.draw(), np.ones(B))
    for _ in range(LAG + 1):
        s.draw()
        assert s.metrics()["curriculum/seen_frac"] == 0  # steps 1..LAG+1 ignore step 0
    s.draw()
    assert s.metrics()["curriculum/seen_frac"] == B / N
    assert s.state()["recent_positions_LxB"].shape == (LAG + 2, B)
    with pytest.raises(ValueError, match=f"step {LAG + 3} needs the observation of step 1 "
                                         rf"\(pass_rate curriculum, lag={LAG + 2}\)"):
        s.draw()
    with pytest.raises(ValueError, match="lag must be an integer >= 1, got 0"):
        make_prompt_sampler("pass_rate", N, B, seed=0, lag=0)
