"""Multi-turn rollouts (`jaxrl.step.multiturn_rollout`, `jaxrl.rollout.slots.extend`): an
observation appended as one chunk equals the full forward and token-by-token decoding; the
token layout, masks and turn boundaries of a scripted environment; the sampler's log-probs
equal the trainer's; slots waiting on an environment do not stall the others; the budget and
turn limits; the same tokens with 1 or 4 slots, and no recompilation on a second call; an
environment that raises, breaks the contract or hangs ends the rollout naming its row and turn
(`jaxrl.step.multiturn.run_episodes`: and the environment and dataset row, as a run says)."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.envs.base import EnvFailure, Observation, ToolStats
from jaxrl.models import PagedKV, Transformer
from jaxrl.models.config import tiny_config
from jaxrl.rollout import Prompts, slots
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.settings import EngineConfig, Generation
from jaxrl.step.forward import completion_log_probs
from jaxrl.step.multiturn import Episodes, run_episodes
from jaxrl.step.multiturn_rollout import MultiTurnConfig, jitted_ops, rollout_multiturn

EOS = 2
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31]]
WIDTH = 6


def turns(max_turns, max_total_tokens, max_turn_tokens, **more) -> MultiTurnConfig:
    """Episodes of at most `max_turns` turns of `max_turn_tokens` tokens within
    `max_total_tokens`, on pages of 4 tokens."""
    limits = Generation(max_new_tokens=max_turn_tokens, max_turns=max_turns,
                        max_total_tokens=max_total_tokens, engine=EngineConfig(page_size=4))
    return MultiTurnConfig(limits, **more)


def encode(text):
    return [int(t) for t in text.split()]


def decode(ids):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny_config("qwen2", vocab_size=48, eos_token_id=EOS), rngs=nnx.Rngs(0))


def _prompts(prompts, g=1):
    ids = np.zeros((len(prompts) * g, WIDTH), np.int32)
    mask = np.zeros((len(prompts) * g, WIDTH), bool)
    for i, p in enumerate(prompts):
        for j in range(g):
            ids[i * g + j, WIDTH - len(p):], mask[i * g + j, WIDTH - len(p):] = p, True
    return ids, mask


class ScriptedEnv:
    """Answers turn k with `answers[k]` (an Observation); records the turns it saw and when."""

    def __init__(self, answers):
        self.answers, self.turns, self.times = list(answers), [], []

    def step(self, turn):
        self.turns.append(turn)
        self.times.append(time.perf_counter())
        return self.answers[min(len(self.turns), len(self.answers)) - 1]


class EchoEnv:
    """Deterministic in the turn's text: echoes its last two tokens plus 40, done after 3."""

    def __init__(self):
        self.n = 0

    def step(self, turn):
        self.n += 1
        last = encode(turn)[-2:]
        if self.n == 3:
            return Observation(done=True, reward=float(sum(last)))
        return Observation(text=decode([*last, 40]), tools=ToolStats(calls=1, latency_s=0.5))


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", {}), ("mistral", {"scan_layers": True}), ("qwen3_moe", {})])
def test_extend_equals_the_full_forward_and_token_by_token_decoding(family, overrides):
    """Prompt, a 3-token turn, then the turn's last token and a 5-token observation as one
    chunk (crossing pages, padded): the chunk's last logits are the full forward's, and the
    same k/v and logits as feeding the tokens one at a time through `decode_paged` (also
    with a sliding window shorter than the chunk, scanned layers, a mixture of experts)."""
    model = Transformer(tiny_config(family, vocab_size=48, eos_token_id=EOS, **overrides),
                        rngs=nnx.Rngs(0))
    sampling = SamplingParams(temperature=0.0)
    layout = PoolLayout.plan(page_size=4, num_prompts=2, prompt_len=WIDTH, max_new_tokens=16,
                             num_slots=2)
    stops = slots.Stops(turn_tokens=3)
    ids, mask = _prompts(PROMPTS[:1])
    state = slots.init(model.config, layout, 2)
    prefix = slots.prefill(model, ids, mask)
    key_1xK = jax.random.key_data(jax.random.key(1))[None]
    first = slots.first_tokens(prefix.logits_PxV, key_1xK, sampling)
    row = slots.Starts(jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), prefix.length_P,
                       *first, key_1xK, jnp.full((1,), 16, jnp.int32))
    state = slots.insert_home(state, layout, prefix, row, 1, stops)  # slot 1
    turn = [int(first[0][0])]
    for _ in range(2):
        state, drawn = slots.generate(model, state, layout, slots.PagedAttentionSettings(), stops,
                                      sampling)
        turn.append(int(drawn.token_S[1]))
    assert bool(drawn.turn_end_S[1]) and not bool(state.live_S[1])  # the turn's 3rd token
    obs = [11, 12, 13, 14, 15]
    chunk = np.zeros((8,), np.int32)
    chunk[:6] = [turn[-1], *obs]
    pos = int(state.pos_S[1])
    assert pos == 3 + 2  # the turn's last token is not fed yet
    extended, logits_V = slots.extend(model, state, layout, 1, chunk, 6, True, stops, sampling)

    full = jnp.asarray([PROMPTS[0] + turn + obs])
    want_V = model(full)[0, -1]
    np.testing.assert_allclose(logits_V, want_V, atol=1e-5, rtol=1e-5)
    assert int(extended.token_S[1]) == int(jnp.argmax(want_V))  # greedy draws from it
    assert int(extended.pos_S[1]) == pos + 6 and bool(extended.live_S[1])

    kv_pages, table = state.kv_pages, state.page_table_SxM
    for i, token in enumerate(chunk[:6]):
        p = pos + i
        paged = PagedKV(kv_pages, table, jnp.asarray([0, p + 1]),
                        jnp.asarray([-1, int(table[1, p // 4])]), jnp.asarray([0, p % 4]))
        step_logits, kv_pages = model.decode_paged(jnp.asarray([0, token]),
                                                   jnp.asarray([0, p]), paged)
    np.testing.assert_allclose(logits_V, step_logits[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(extended.kv_pages, kv_pages, atol=1e-5, rtol=1e-5)


def test_a_scripted_environment_gives_the_layout_masks_and_boundaries(model):
    """Turns of 4 tokens (no stop tokens); observation 1 as ids, observation 2 as text,
    done with a reward after turn 3."""
    answers = [Observation(ids=[30, 31, 32], tools=ToolStats(calls=1, errors=1, latency_s=0.25)),
               Observation(text="41 42"),
               Observation(done=True, reward=1.5, tools=ToolStats(calls=2, timeouts=1))]
    envs = [ScriptedEnv(answers), ScriptedEnv(answers[:1] + [Observation(done=True)])]
    ids, mask = _prompts(PROMPTS[:2])
    config = turns(5, 24, 4, num_slots=2, chunk_width=8)
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(0), config)
    r = out.rollout
    comp, cmask = np.asarray(r.completion_ids_BxC), np.asarray(r.completion_mask_BxC)
    obs = out.observation_mask_BxC
    # Row 0: turn (0-4) | 30 31 32 | turn (7-11) | 41 42 | turn (13-17) | pad.
    assert out.num_turns_B.tolist() == [3, 2]
    assert out.turn_starts_BxK[0].tolist() == [0, 7, 13, -1, -1]
    assert out.turn_ends_BxK[0].tolist() == [4, 11, 17, -1, -1]
    assert out.turn_starts_BxK[1].tolist()[:3] == [0, 7, -1]
    assert comp[0, 4:7].tolist() == [30, 31, 32] and comp[0, 11:13].tolist() == [41, 42]
    assert obs[0].nonzero()[0].tolist() == [4, 5, 6, 11, 12]
    assert cmask[0].tolist() == [True] * 17 + [False] * 7
    assert cmask[1].sum() == 11 and obs[1].nonzero()[0].tolist() == [4, 5, 6]
    model_tokens = cmask & ~obs
    logp = np.asarray(r.logp_raw_BxC)
    assert np.all(logp[model_tokens] < 0) and np.all(logp[~model_tokens] == 0)
    # The environment saw each turn's text (its own tokens, decoded).
    assert envs[0].turns == [decode(comp[0, s:e].tolist())
                             for s, e in zip(out.turn_starts_BxK[0][:3], out.turn_ends_BxK[0][:3],
                                             strict=True)]
    assert out.reward_B[0] == 1.5 and np.isnan(out.reward_B[1])
    assert out.tool_calls_B.tolist() == [3, 1] and out.tool_errors_B.tolist() == [1, 1]
    assert out.tool_timeouts_B.tolist() == [1, 0]
    np.testing.assert_allclose(out.tool_latency_s_B, [0.25, 0.25])
    assert not out.truncated_B.any() and int(r.num_steps) == 17


@pytest.mark.parametrize("g, family", [(1, "qwen2"), (2, "qwen2"), (2, "mistral")])
def test_sampler_log_probs_equal_the_trainers(model, g, family):
    """The trainer's forward over prompt + completion (observations included) gives the
    rollout's logp_raw on every model token; at temperature 1 without filters logp too.
    Observations (3 tokens after the turn's last) take 2 `extend` chunks of 3. (mistral: a
    sliding window of 4 tokens, scanned layers.)"""
    if family != "qwen2":
        model = Transformer(tiny_config(family, vocab_size=48, eos_token_id=EOS,
                                        scan_layers=True), rngs=nnx.Rngs(1))
    sampling = SamplingParams(temperature=1.0)
    ids, mask = _prompts(PROMPTS, g)
    envs = [EchoEnv() for _ in range(len(ids))]
    config = turns(4, 24, 5, num_slots=3, chunk_width=3, turn_end_token_ids=(7, 9))
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(2), config,
                            sampling, num_generations=g)
    r = out.rollout
    cmask = np.asarray(r.completion_mask_BxC)
    loss_mask = out.loss_mask_BxC
    assert (loss_mask == (cmask & ~out.observation_mask_BxC)).all() and loss_mask.any()
    batch = {"ids_BxT": jnp.concatenate([r.prompt_ids_BxP, r.completion_ids_BxC], axis=1),
             "mask_BxT": jnp.concatenate([r.prompt_mask_BxP, r.completion_mask_BxC], axis=1),
             "loss_mask_BxC": jnp.asarray(loss_mask)}
    trainer_BxC, _ = completion_log_probs(model, batch, 1.0)
    np.testing.assert_allclose(np.where(loss_mask, trainer_BxC, 0), r.logp_raw_BxC,
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(r.logp_BxC, r.logp_raw_BxC, atol=1e-6)
    assert out.observation_mask_BxC.sum() > 0 and out.num_turns_B.max() == 3
    assert (out.tool_calls_B == out.num_turns_B.clip(max=2)).all()  # 2 observations at most


def test_a_slow_environment_does_not_stall_the_other_slots(model):
    """Row 0's environment holds its first turn until the other 3 rows have run all their
    turns (through the other slot of 2), then sleeps 0.3 s: an engine that waits on row 0 never
    releases it. A gate, not a fixed sleep, so that a loaded host cannot fail it."""
    answers = [Observation(ids=[30, 31]), Observation(done=True, reward=1.0)]
    ids, mask = _prompts(PROMPTS)
    config = turns(3, 16, 3, num_slots=2, chunk_width=8)
    others_done = threading.Event()

    class Slow(ScriptedEnv):
        def step(self, turn):
            if not self.turns:
                self.released = others_done.wait(timeout=120)
                time.sleep(0.3)
            return super().step(turn)

    class Fast(ScriptedEnv):
        def step(self, turn):
            observation = super().step(turn)
            if all(len(e.times) == 2 for e in envs[1:]):
                others_done.set()
            return observation

    fast = rollout_multiturn(model, ids, mask, [ScriptedEnv(answers) for _ in range(4)],
                             encode, decode, jax.random.key(3), config)  # compiles first
    envs = [Slow(answers), *(Fast(answers) for _ in range(3))]
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(3), config)
    assert envs[0].released, "the other rows did not finish while row 0's environment ran"
    assert all(len(e.times) == 2 and e.times[-1] < envs[0].times[0] for e in envs[1:])
    assert out.env_wait_s > 0.1 and out.env_time_s > 0.3
    assert threading.active_count() < 20
    # Timing changed nothing about the tokens.
    np.testing.assert_array_equal(out.rollout.completion_ids_BxC, fast.rollout.completion_ids_BxC)


def test_budget_and_turn_limits_end_the_episode(model):
    ids, mask = _prompts(PROMPTS[:2])
    long_obs = Observation(ids=list(range(20, 30)))
    # Budget 12, turns of 4: turn | 8 of the 10 observation tokens, and the episode ends.
    config = turns(5, 12, 4, num_slots=2, chunk_width=8)
    envs = [ScriptedEnv([long_obs]) for _ in range(2)]
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(4), config)
    comp = np.asarray(out.rollout.completion_ids_BxC)
    assert comp[:, 4:].tolist() == [list(range(20, 28))] * 2
    assert out.observation_mask_BxC.sum(axis=1).tolist() == [8, 8]
    assert out.num_turns_B.tolist() == [1, 1] and out.truncated_B.all()
    # A turn cut by the budget (turn 2: 1 of 10 tokens, after 10 and an observation of 1):
    # the environment still sees it, and its reward is the row's.
    config = turns(5, 12, 10, num_slots=2, chunk_width=8)
    envs = [ScriptedEnv([Observation(ids=[30]), Observation(ids=[31], reward=0.5)])
            for _ in range(2)]
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(4), config)
    assert np.asarray(out.rollout.completion_mask_BxC).all() and out.truncated_B.all()
    assert out.turn_ends_BxK[:, :2].tolist() == [[10, 12]] * 2
    assert [len(e.turns) for e in envs] == [2, 2] and out.reward_B.tolist() == [0.5, 0.5]
    # max_turns 2 with an environment that never ends: 2 turns, the second observation dropped.
    config = turns(2, 24, 4, num_slots=2, chunk_width=8)
    envs = [ScriptedEnv([Observation(ids=[30, 31])]) for _ in range(2)]
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(4), config)
    assert out.num_turns_B.tolist() == [2, 2] and [len(e.turns) for e in envs] == [2, 2]
    assert np.asarray(out.rollout.completion_mask_BxC).sum(axis=1).tolist() == [10, 10]
    assert out.truncated_B.all()


def test_one_or_four_slots_give_the_same_tokens_without_recompiling(model):
    sampling = SamplingParams(temperature=1.0, top_k=20)
    ids, mask = _prompts(PROMPTS, 2)

    def run(slots):
        config = turns(4, 24, 5, num_slots=slots, chunk_width=4, turn_end_token_ids=(7, 9),
                       eos_token_ids=(EOS,))
        envs = [EchoEnv() for _ in range(len(ids))]
        return rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(5),
                                 config, sampling, num_generations=2)

    one = run(1)
    four = run(4)
    sizes = {name: f._cache_size() for name, f in jitted_ops().items()}
    again = run(4)
    assert {name: f._cache_size() for name, f in jitted_ops().items()} == sizes
    for a, b in ((one, four), (four, again)):
        for name in ("completion_ids_BxC", "completion_mask_BxC", "logp_BxC"):
            np.testing.assert_allclose(getattr(a.rollout, name), getattr(b.rollout, name),
                                       atol=1e-5)
        np.testing.assert_array_equal(a.turn_ends_BxK, b.turn_ends_BxK)
        np.testing.assert_array_equal(a.reward_B, b.reward_B)
    assert one.decode_steps > four.decode_steps


def test_a_failing_environment_names_its_row(model):
    class Broken:
        def step(self, turn):
            raise KeyError("tool")

    ids, mask = _prompts(PROMPTS[:2])
    config = turns(2, 12, 4, num_slots=2, chunk_width=8)
    envs = [ScriptedEnv([Observation(done=True)]), Broken()]
    with pytest.raises(EnvFailure, match=r"^sample 1, turn 1: env.step\(turn\) raised "
                                         r"KeyError: 'tool'$"):
        rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(0), config)
    mask[0] = False
    with pytest.raises(ValueError, match=r"rows \[0\] have an empty prompt"):
        rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(0), config)


def test_observation_ids_outside_the_vocabulary_are_counted_never_fed(model):
    """Observations whose ids fall outside the model's vocabulary of 48, given (sample 1) or
    encoded from text by a tokenizer that knows more tokens than the model's embedding
    (sample 2), are counted with the first one's message, never fed: their episodes end
    there, truncated; the run goes on."""
    ids, mask = _prompts(PROMPTS[:2], 2)
    config = turns(2, 12, 4, num_slots=2, chunk_width=8)  # the programs of the test above
    envs = [ScriptedEnv([Observation(done=True)]), ScriptedEnv([Observation(ids=[3, 48])]),
            ScriptedEnv([Observation(text="3 48 50")]), ScriptedEnv([Observation(text="3 4")])]
    out = rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(0), config,
                            num_generations=2)
    assert out.vocab_errors_B.tolist() == out.tool_errors_B.tolist() == [0, 1, 1, 0]
    assert out.truncated_B.tolist()[1:3] == [True, True]
    assert out.vocab_error == ("sample 1, turn 1: Observation.ids must be token ids in "
                               "[0, 48) (the model's vocabulary), got [48]")
    assert not out.observation_mask_BxC[1:3].any()  # nothing of theirs was fed
    assert out.observation_mask_BxC[3].sum() == 2  # "3 4": fed


def test_a_run_names_the_environment_and_dataset_row_of_a_failure(model):
    """`run_episodes`, as a run calls it: prompts of dataset rows 7 and 9, two samples each,
    the third sample's environment broken. A broken contract (a reward that is not a finite
    number) ends the rollout at its turn, named with `data.env` and the sample's dataset row;
    so does a factory that fails on that sample."""
    ids, mask = _prompts(PROMPTS[:2])
    config = turns(2, 12, 4, num_slots=2, chunk_width=8)  # the programs of the test above
    rows = [{"id": i} for i in range(10)]

    def broken_third(make_bad):
        made = []

        def make_env(row):
            made.append(row)
            return make_bad() if len(made) == 3 else ScriptedEnv([Observation(done=True)])
        return make_env

    def exhausted():
        raise OSError("the simulator pool is exhausted")

    where = "data.env='tests:scripted', dataset row 9 (sample 2 of the batch)"
    for make_bad, message in (
            (lambda: ScriptedEnv([Observation(reward=float("nan"))]),
             f"{where}, turn 1: Observation.reward must be a finite number or None, got nan"),
            (exhausted, f"{where}: the factory (row -> Environment) raised OSError: the "
                        f"simulator pool is exhausted")):
        episodes = Episodes(broken_third(make_bad), rows, encode, decode, config,
                            spec="tests:scripted")
        with pytest.raises(EnvFailure) as info:
            run_episodes(model, episodes, Prompts(ids, mask), [7, 9], jax.random.key(0), None,
                         2)
        assert str(info.value) == message


def test_a_huge_text_observation_is_cut_before_it_is_tokenized(model):
    """A 1 MB observation with room for 8 tokens: the tokenizer is given a few dozen
    characters of it, never the megabyte (which took ~2 s a turn with a real tokenizer), and
    the episode ends with the 8 tokens that fit."""
    seen = []

    def counting_encode(text):
        seen.append(len(text))
        return encode(text)

    ids, mask = _prompts(PROMPTS[:2])
    huge = Observation(text=" ".join(["21"] * 350_000))  # 1,049,999 characters
    config = turns(5, 12, 4, num_slots=2, chunk_width=8)
    envs = [ScriptedEnv([huge]) for _ in range(2)]
    out = rollout_multiturn(model, ids, mask, envs, counting_encode, decode, jax.random.key(4),
                            config)
    assert np.asarray(out.rollout.completion_ids_BxC)[:, 4:].tolist() == [[21] * 8] * 2
    assert out.num_turns_B.tolist() == [1, 1] and out.truncated_B.all()
    assert seen and max(seen) <= 8 * 9, seen


def test_a_slow_environment_past_its_time_limit_names_its_row_and_turn(model):
    class Hang:
        def step(self, turn):
            time.sleep(30)

    ids, mask = _prompts(PROMPTS[:2])
    config = turns(2, 12, 4, num_slots=2, chunk_width=8, env_timeout_s=0.5)
    envs = [ScriptedEnv([Observation(done=True)]), Hang()]
    start = time.monotonic()
    with pytest.raises(EnvFailure, match=r"^sample 1, turn 1: env.step\(turn\) did not return "
                                         r"within the time limit \(data.env_timeout_s=0.5;"):
        rollout_multiturn(model, ids, mask, envs, encode, decode, jax.random.key(0), config)
    assert time.monotonic() - start < 10  # not the 30 s of the hung call
