"""Golden outputs of the rollout engines, recorded before they were merged into one.

The RL engine's rows (temperature 1, fixed keys; continuous and static batching, with and
without tail halving), the serving engine's requests (greedy and sampled, two slots, as a
server drives them) and multi-turn episodes (an environment that echoes the turn) were
recorded from the three engines of commit 4dca018 into `golden_engines.json`; the engine
that replaces them must give the same tokens, token for token, and the same log-probs, on
one device and with the slots split over 8 devices.

    python -m tests.rollout.test_golden --record     rewrite the file (only on purpose)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.envs.base import Observation
from jaxrl.models import Transformer
from jaxrl.models.config import tiny_config
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.settings import EngineConfig, Generation

GOLDEN = Path(__file__).with_name("golden_engines.json")
EOS = 2
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31], [8, 9, 10, 11], [40, 41, 42]]
FAMILIES = {"qwen2": {}, "mistral": {"scan_layers": True}}
STOP = 17  # a token the tiny random models draw now and then: rows of every length


def _model(family):
    config = tiny_config(family, vocab_size=48, eos_token_id=EOS, **FAMILIES[family])
    return Transformer(config, rngs=nnx.Rngs(0))


def _left_padded(prompts, width=6):
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, True
    return ids, mask


# -- the drivers: each engine's API (the one engine's drivers since issue 39) -----------------

RL_CASES = {  # name: engine settings
    "continuous_3_slots": dict(max_slots=3, page_size=4),
    "continuous_halving": dict(max_slots=8, page_size=4, min_slots=2),
    "static_4_slots": dict(max_slots=4, page_size=4, batching="static"),
}


def rl_rows(model, case):
    """Rows of 6 prompts x 2 samples, up to 9 new tokens, temperature 1."""
    from jaxrl.rollout.decode_loop import EngineConfig, sample_continuous
    from jaxrl.rollout.types import SamplerConfig

    ids, mask = _left_padded(PROMPTS)
    config = SamplerConfig(max_new_tokens=9, num_generations=2, end_token_ids=(STOP,),
                           sampling=SamplingParams(temperature=1.0),
                           engine=EngineConfig(**RL_CASES[case]))
    out = jax.jit(lambda m: sample_continuous(m, ids, mask, jax.random.key(7), config))(model)
    mask_BxC = np.asarray(out.completion_mask_BxC)
    return {"tokens": [np.asarray(r)[m].tolist() for r, m in zip(out.completion_ids_BxC,
                                                                  mask_BxC, strict=True)],
            "logp": [np.asarray(r)[m].tolist() for r, m in zip(out.logp_BxC, mask_BxC,
                                                               strict=True)],
            "logp_raw": [np.asarray(r)[m].tolist() for r, m in zip(out.logp_raw_BxC, mask_BxC,
                                                                   strict=True)]}


def served(model, temperature, layout=None, num_slots=2):
    """Every prompt as a server drives the engine: a request takes the first free slot (on
    the mesh of sharding `layout`, the slots split over its devices as `jaxrl serve` splits
    them)."""
    from jaxrl.rollout import serving, slots
    from jaxrl.rollout.types import row_keys

    split, graphdef, weights = _on_mesh(model, layout, num_slots)
    sampling = SamplingParams(temperature=temperature)
    pool = serving.pool_layout(split.local_slots, max_prefill_length=8, max_new_tokens=9,
                               page_size=4)
    stops = slots.Stops(row_ids=(STOP,))
    keys = row_keys(jax.random.key(3), len(PROMPTS), 1)

    @jax.jit
    def prefill(weights, ids_L, n, key):
        with split.use_rules():
            return serving.prefill_request(nnx.merge(graphdef, weights), ids_L, n, key, sampling, 9)

    @jax.jit
    def insert(state, prefix, slot):
        return split.on_owner(lambda state, slot, prefix: serving.insert_request(
            state, prefix, slot, pool, stops), state, slot, prefix)

    @jax.jit
    def generate(weights, state):
        return split.on_each(lambda state, weights: serving.emit_and_generate(
            nnx.merge(graphdef, weights), state, pool, stops, sampling,
            slots.PagedAttentionSettings()),
            state, weights)

    state = jax.jit(lambda: split.init(model.config, pool))()
    assert state.row_S.shape == (num_slots,)  # every device's slots, side by side
    pending, owner, outputs = list(range(len(PROMPTS))), {}, [[] for _ in PROMPTS]
    while pending or owner:
        for slot in split.fill_order():
            if slot not in owner and pending:
                i = pending.pop(0)
                ids_L = np.zeros((8,), np.int32)
                ids_L[:len(PROMPTS[i])] = PROMPTS[i]
                prefix = prefill(weights, ids_L, len(PROMPTS[i]), keys[i])
                state, owner[slot] = insert(state, prefix, slot), i
        state, out = generate(weights, state)
        for slot in list(owner):
            if bool(out.valid_S[slot]):
                outputs[owner[slot]].append(int(out.token_S[slot]))
            else:
                del owner[slot]
    return outputs


def _on_mesh(model, layout, num_slots):
    """(split, graphdef, weights): the slots' split on the mesh of sharding preset `layout`
    (None: one device) and the weights laid out by its rollout rules."""
    from jaxrl.rollout.slots_on_mesh import SlotSplit
    from jaxrl.sharding import state_shardings

    graphdef, weights = nnx.split(model)
    mesh, rules = _mesh(layout)
    if mesh is not None:
        weights = jax.device_put(weights, state_shardings(weights, mesh, rules))
    return SlotSplit.over(mesh, rules, num_slots), graphdef, weights


def _mesh(layout):
    """(mesh, rollout rules) of sharding preset `layout` on the 8 devices; (None, None)."""
    from jaxrl.sharding import make_mesh, resolve_layout

    if layout is None:
        return None, None
    preset = resolve_layout(layout)
    return make_mesh(preset), preset.rollout_rules


class EchoEnv:
    """Echoes the turn's last two tokens plus 40; done (reward: their sum) at its 3rd turn."""

    def __init__(self):
        self.n = 0

    def step(self, turn):
        self.n += 1
        last = [int(t) for t in turn.split()][-2:]
        if self.n == 3:
            return Observation(done=True, reward=float(sum(last)))
        return Observation(text=" ".join(map(str, [*last, 40])))


def episodes(model, layout=None, num_slots=3):
    """4 prompts x 2 samples, 3 slots, temperature 1, turns end on STOP or 4 tokens (on the
    mesh of sharding `layout`, the slots split over its devices)."""
    from jaxrl.step.multiturn_rollout import MultiTurnConfig, rollout_multiturn

    prompts = PROMPTS[:4]
    ids, mask = _left_padded(prompts)
    ids, mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
    turns = Generation(max_new_tokens=4, max_turns=3, max_total_tokens=20,
                       engine=EngineConfig(page_size=4))
    config = MultiTurnConfig(turns, num_slots=num_slots, turn_end_token_ids=(STOP,),
                             eos_token_ids=(EOS,), chunk_width=8)
    mesh, rules = _mesh(layout)
    out = rollout_multiturn(model, ids, mask, [EchoEnv() for _ in range(8)],
                            lambda text: [int(t) for t in text.split()],
                            lambda ids: " ".join(map(str, ids)), jax.random.key(11), config,
                            num_generations=2, mesh=mesh, rules=rules)
    r = out.rollout
    mask_BxC = np.asarray(r.completion_mask_BxC)
    return {"tokens": [np.asarray(x)[m].tolist() for x, m in zip(r.completion_ids_BxC,
                                                                 mask_BxC, strict=True)],
            "observation": [np.asarray(x)[m].astype(int).tolist() for x, m in zip(
                out.observation_mask_BxC, mask_BxC, strict=True)],
            "logp": [np.asarray(x)[m].tolist() for x, m in zip(r.logp_BxC, mask_BxC,
                                                               strict=True)],
            "turn_starts": np.asarray(out.turn_starts_BxK).tolist(),
            "turn_ends": np.asarray(out.turn_ends_BxK).tolist(),
            "reward": [None if np.isnan(x) else float(x) for x in out.reward_B]}


def record() -> dict:
    golden = {}
    for family in FAMILIES:
        model = _model(family)
        golden[family] = {
            "rl": {case: rl_rows(model, case) for case in RL_CASES},
            "served": {"greedy": served(model, 0.0), "sampled": served(model, 1.0)},
            "episodes": episodes(model)}
    return golden


# -- the checks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request):
    return request.param, _model(request.param)


def _same_rows(got, want, what):
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    for name in ("logp", "logp_raw"):
        if name in want:
            for g, w in zip(got[name], want[name], strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("case", list(RL_CASES))
def test_rl_rows_are_the_recorded_ones(family_model, golden, case):
    family, model = family_model
    want = golden[family]["rl"][case]
    assert any(len(t) < 9 for t in want["tokens"]) and any(len(t) == 9 for t in want["tokens"])
    _same_rows(rl_rows(model, case), want, f"{family} {case}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_served_requests_are_the_recorded_ones(family_model, golden, temperature):
    family, model = family_model
    want = golden[family]["served"]["greedy" if temperature == 0.0 else "sampled"]
    assert served(model, temperature) == want


# On 8 devices: the slots split over data x fsdp, 2 per device (fsdp: 8 ways; dp_fsdp_tp:
# 2 x 2 ways, KV heads and the weights over tensor = 2), each device decoding its own.
MESH_SLOTS = {"fsdp": 16, "dp_fsdp_tp": 8}


@pytest.mark.parametrize("layout, temperature", [("fsdp", 0.0), ("dp_fsdp_tp", 1.0)])
def test_served_requests_on_a_mesh_are_the_recorded_ones(family_model, golden, layout,
                                                         temperature):
    family, model = family_model
    want = golden[family]["served"]["greedy" if temperature == 0.0 else "sampled"]
    split = _on_mesh(model, layout, MESH_SLOTS[layout])[0]
    assert split.devices == MESH_SLOTS[layout] // 2, split.describe()
    assert served(model, temperature, layout, MESH_SLOTS[layout]) == want


@pytest.mark.parametrize("layout", [None, "dp_fsdp_tp"])
def test_episodes_are_the_recorded_ones(family_model, golden, layout):
    """On one device, and on the (2, 2, 2) mesh with the slots split 4 ways."""
    family, model = family_model
    if layout is None:
        got = episodes(model)
    else:
        assert _on_mesh(model, layout, MESH_SLOTS[layout])[0].devices == 4
        got = episodes(model, layout, MESH_SLOTS[layout])
    want = golden[family]["episodes"]
    for name in ("observation", "turn_starts", "turn_ends", "reward"):
        assert got[name] == want[name], f"{family}: {name} differ"
    _same_rows(got, want, f"{family} episodes")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    GOLDEN.write_text(json.dumps(record(), indent=None) + "\n")
    print(f"wrote {GOLDEN}")
