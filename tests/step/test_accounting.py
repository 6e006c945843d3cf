"""FLOP accounting of the RL step: XLA's count of the loop-free phase programs against the
analytic count, trip counts from the algo config, remat in the hardware count, deep models."""

import dataclasses
import functools

import jax
import pytest
from flax import nnx

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.config.critic import CriticSection
from jaxrl.models import Transformer
from jaxrl.models.config import tiny_config
from jaxrl.perf.flops import program_cost
from jaxrl.rl import PolicyLossConfig
from jaxrl.rollout import SamplerConfig
from jaxrl.rollout.settings import EngineConfig
from jaxrl.sharding import load_layout, make_mesh
from jaxrl.step import create_train_state
from jaxrl.step.accounting import StepShapes, _Phases, _trips, account_step

# Small, but with matmuls large enough that elementwise work (norms, softmax, RoPE) is a
# few percent of the count, as in real models.
CONFIG = tiny_config("qwen2", hidden_size=128, intermediate_size=512, num_heads=4,
                     num_kv_heads=2, head_dim=32, vocab_size=256)
SHAPES = StepShapes(prompts=4, prompt_len=8, generations=4, max_new_tokens=8)
ALGO = AlgoSection(num_iterations=2, num_minibatches=2, microbatch_size=4,
                  loss=PolicyLossConfig(beta=0.04))


# A mixture of 8 experts, 2 per token: model FLOPs count the routed experts only.
MOE = tiny_config("qwen3_moe", hidden_size=128, moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  vocab_size=256)


# The engine as runs use it (`rollout.engine_config()`), with 4 slots for the 16 rows and
# pages of 4 tokens read 2 pages a block: a page table of 4 pages, 2 blocks.
ENGINE = EngineConfig(max_slots=4, page_size=4, pages_per_block=2)


@functools.cache
def _account(layout="single", remat="none", chunk=None, layers=2, algo=ALGO, base=CONFIG,
             engine=None):
    config = dataclasses.replace(base, remat=remat, num_layers=layers)
    lay = load_layout(layout)
    mesh = make_mesh(lay, jax.devices()[:1] if layout == "single" else None)
    ts = create_train_state(lambda: Transformer(config, rngs=nnx.Rngs(0)), OptimSection(), mesh,
                            lay.train_rules,
                            critic=algo.critic if algo.advantage == "gae" else None)
    graphdef, state = nnx.split(ts)
    algo = dataclasses.replace(algo, logprob_chunk_size=chunk)
    sampler = SamplerConfig(max_new_tokens=SHAPES.max_new_tokens,
                            num_generations=SHAPES.generations, engine=engine)
    return account_step(algo, config, sampler, SHAPES, graphdef, state)


def _phases(step_flops):
    return {p.cost.name: p for p in (*step_flops.generate, *step_flops.train)}


def test_trip_counts_follow_the_algo_config():
    phases = _phases(_account().model)
    # 16 rows: 4 microbatches of 4; old and reference log-probs (beta > 0) for each.
    assert phases["logprobs"].trips == 4 * 2
    # 2 iterations x 2 minibatches of 8 rows x 2 microbatches of 4.
    assert phases["grad"].trips == 2 * 2 * 2
    assert phases["update"].trips == 2 * 2
    assert phases["prefill"].trips == 1 and phases["decode"].per_decode_step


def test_a_single_update_step_runs_no_old_log_prob_forward():
    trips = _trips(AlgoSection(microbatch_size=4), SHAPES, CONFIG)
    assert trips["logprobs"] == 0 and trips["grad"] == 4 and trips["update"] == 1
    with_kl = _trips(AlgoSection(microbatch_size=4, loss=PolicyLossConfig(beta=0.1)), SHAPES, CONFIG)
    assert with_kl["logprobs"] == 4  # the reference forward only


@pytest.mark.parametrize("phase", ["prefill", "decode", "logprobs", "grad"])
def test_xla_model_flops_match_the_analytic_count_within_5_percent(phase):
    acc = _account()
    xla, expected = _phases(acc.model)[phase].cost.flops, _phases(acc.analytic)[phase].cost.flops
    # Elementwise work is what XLA counts on top of the matmuls: never less, a few % more.
    assert expected <= xla <= 1.05 * expected, (phase, xla, expected)


# XLA's count of an MoE layer's gradient follows its default CPU fusions (the older
# emitters' program counts 11% fewer FLOPs than the analytic count).
@pytest.mark.parametrize("phase", ["prefill", "decode", "logprobs", pytest.param(
    "grad", marks=pytest.mark.default_compiler)])
def test_moe_model_flops_count_the_routed_experts_and_match_the_analytic_count(phase):
    acc = _account(base=MOE)
    xla, expected = _phases(acc.model)[phase].cost.flops, _phases(acc.analytic)[phase].cost.flops
    assert expected <= xla <= 1.05 * expected, (phase, xla, expected)


def test_xla_counts_every_expert_of_a_ragged_dot_on_the_host():
    # Why the accounting compiles MoE layers with gathered weights: XLA:CPU lowers
    # ragged_dot to a masked dense dot over all groups, and counts it so.
    m, k, n, groups = 64, 32, 48, 8
    cost = program_cost("ragged", jax.jit(jax.lax.ragged_dot).lower(
        jax.ShapeDtypeStruct((m, k), "float32"), jax.ShapeDtypeStruct((groups, k, n), "float32"),
        jax.ShapeDtypeStruct((groups,), "int32")).compile())
    assert cost.flops >= groups * 2 * m * k * n


def test_step_total_is_phases_times_trips():
    acc = _account()
    phases = _phases(acc.model)
    manual = (phases["prefill"].cost.flops + 5 * phases["decode"].cost.flops
              + sum(phases[n].cost.flops * phases[n].trips for n in ("logprobs", "grad", "update")))
    assert acc.metrics(5)["perf/model_flops"] == pytest.approx(manual)
    assert acc.metrics(7)["perf/model_flops"] > acc.metrics(5)["perf/model_flops"]
    # The loop's one-row forward passes, over B rows: B x 5 of them are 5 B-row steps; an
    # engine with B / 4 slots that ran 8 iterations ran 2 of them.
    assert acc.decode_steps(SHAPES.rows * 5) == 5
    assert acc.decode_steps(SHAPES.rows // 4 * 8) == 2
    # One device, no remat, no chunking: the hardware program is the model program.
    assert acc.hardware is acc.model


def test_remat_adds_hardware_flops_but_not_model_flops():
    plain, remat = _account(), _account(remat="block")
    assert remat.model == plain.model  # model FLOPs are counted without remat
    grad_plain = _phases(plain.hardware)["grad"].cost.flops
    grad_remat = _phases(remat.hardware)["grad"].cost.flops
    # Recomputing each block's forward in the backward pass: about one more forward of the
    # layers (a third of fwd + bwd), less the vocabulary projection.
    assert grad_plain * 1.15 < grad_remat < grad_plain * 1.4
    assert _phases(remat.hardware)["decode"].cost.flops == pytest.approx(
        _phases(plain.hardware)["decode"].cost.flops)


def test_chunked_log_probs_are_counted_in_every_chunk():
    plain, chunked = _account(), _account(chunk=64)  # 4 chunks of the 256-token vocabulary
    logp_plain = _phases(plain.model)["logprobs"].cost.flops
    logp_chunked = _phases(chunked.hardware)["logprobs"].cost.flops
    # A loop counted once would see a quarter of the vocabulary projection.
    assert logp_chunked == pytest.approx(logp_plain, rel=0.05)


def test_a_cudnn_attention_config_is_counted_with_xla_attention_on_the_host():
    cudnn = dataclasses.replace(CONFIG, attention_impl="cudnn")
    sampler = SamplerConfig(max_new_tokens=SHAPES.max_new_tokens,
                            num_generations=SHAPES.generations)
    phases = _Phases(ALGO, cudnn, sampler, SHAPES, _trips(ALGO, SHAPES, CONFIG), remat="none",
                     chunk_size=None, num_layers=1)
    assert phases.config.attention_impl == "xla"
    decode = program_cost("decode", phases.lower()["decode"].compile())
    assert decode.flops and decode.flops > 0


def test_deep_models_are_counted_exactly_from_one_and_two_layers():
    deep = _account(layers=3)  # counted from 1- and 2-layer compiles
    phases = _phases(deep.model)
    direct = _Phases(ALGO, dataclasses.replace(CONFIG, num_layers=3),
                     SamplerConfig(max_new_tokens=SHAPES.max_new_tokens,
                                   num_generations=SHAPES.generations),
                     SHAPES, _trips(ALGO, SHAPES, CONFIG), remat="none", chunk_size=None,
                     num_layers=3).lower()
    for name, lowered in direct.items():
        assert phases[name].cost.flops == pytest.approx(
            program_cost(name, lowered.compile()).flops, rel=1e-6), name
    two = _phases(_account().model)
    assert phases["grad"].cost.flops > 1.3 * two["grad"].cost.flops


def test_a_prompt_shared_by_its_group_is_counted_once_per_microbatch():
    # Microbatches of 8 rows (strided slices of 2): each holds 2 rows of every prompt.
    shared_algo = dataclasses.replace(ALGO, num_minibatches=1, microbatch_size=8)
    shared = _account(algo=shared_algo)
    whole = _account(algo=dataclasses.replace(shared_algo, share_prompts=False))
    assert _trips(shared_algo, SHAPES, CONFIG)["prompt_group"] == 2
    for phase in ("logprobs", "grad"):
        xla, expected = (_phases(acc.model)[phase].cost.flops for acc in (shared, whole)), (
            _phases(acc.analytic)[phase].cost.flops for acc in (shared, whole))
        (xla_shared, xla_whole), (analytic_shared, analytic_whole) = xla, expected
        assert analytic_shared <= xla_shared <= 1.05 * analytic_shared, phase
        # Half the prompt forwards: fewer FLOPs, in the analytic proportion.
        assert xla_shared < xla_whole
        assert xla_shared / xla_whole == pytest.approx(analytic_shared / analytic_whole,
                                                       rel=0.02), phase


@pytest.mark.parametrize("kind", ["separate", "value_head"])
def test_ppo_critic_work_is_counted_and_matches_the_analytic_count(kind):
    ppo = dataclasses.replace(ALGO, advantage="gae", critic=CriticSection(kind=kind))
    acc, grpo = _phases(_account(algo=ppo).model), _phases(_account().model)
    analytic = _phases(_account(algo=ppo).analytic)
    assert acc["values"].trips == 4  # V_old: one forward per microbatch of the 16 rows
    for phase in ("values", "grad"):
        xla, expected = acc[phase].cost.flops, analytic[phase].cost.flops
        assert expected <= xla <= 1.05 * expected, (phase, xla, expected)
    # The values forward is a trunk without the vocabulary projection: less than a log-prob
    # forward. A separate critic's trunk doubles the gradient's layer work; a value head
    # adds only its own few FLOPs.
    assert acc["values"].cost.flops < grpo["logprobs"].cost.flops
    ratio = acc["grad"].cost.flops / grpo["grad"].cost.flops
    assert 1.5 < ratio < 2.0 if kind == "separate" else 1.0 < ratio < 1.02, ratio
    assert acc["update"].cost.flops > grpo["update"].cost.flops


def test_an_engine_run_counts_the_engines_own_prefill_and_decode_iteration():
    """With an engine the decode program counted is the engine's loop iteration: its 4 slots
    (not the 16 rows), reading the page pool; one slot's work is about one dense row's."""
    acc, dense = _account(engine=ENGINE), _account()
    assert acc.rows == 4 and dense.rows == SHAPES.rows
    # 4 slots x 8 iterations are 8 runs of the 4-slot program.
    assert acc.decode_steps(4 * 8) == 8
    sampler = SamplerConfig(max_new_tokens=SHAPES.max_new_tokens,
                            num_generations=SHAPES.generations, engine=ENGINE)
    phases = _Phases(ALGO, CONFIG, sampler, SHAPES, _trips(ALGO, SHAPES, CONFIG), remat="none",
                     chunk_size=None, num_layers=1).lower()
    shapes = {x.shape for x in jax.tree.leaves(phases["decode"].args_info)}
    # The pool: [layers, pages (4 prompts x 2 + 4 slots x 3 own, a worst-case row's),
    # page size, 2 K, H].
    assert (1, 4 * 2 + 4 * 3, 4, 2 * CONFIG.num_kv_heads, CONFIG.head_dim) in shapes
    assert (4, 4) in shapes  # the slots' page table
    model, analytic = _phases(acc.model), _phases(acc.analytic)
    for phase in ("prefill", "decode"):
        xla, expected = model[phase].cost.flops, analytic[phase].cost.flops
        assert expected <= xla <= 1.05 * expected, (phase, xla, expected)
    per_slot = model["decode"].cost.flops / acc.rows
    per_row = _phases(dense.model)["decode"].cost.flops / dense.rows
    assert per_slot == pytest.approx(per_row, rel=0.05)
    # The train phases do not depend on the sampler.
    assert model["grad"] == _phases(dense.model)["grad"]
