"""The `algo` and `optim` sections: every bad value names its key and the value."""

import pytest

from jaxrl.config import AlgoSection, ConfigError, OptimSection, load_config
from jaxrl.config.algo import resolve_logprob_chunk
from jaxrl.config.critic import CriticSection
from jaxrl.rl import PolicyLossConfig


def test_config_is_validated_with_field_and_value():
    for kwargs, match in ((dict(advantage="ppo"), "algo.advantage.*'ppo'"),
                          (dict(num_iterations=0), "algo.num_iterations.*0"),
                          (dict(num_minibatches=True), "algo.num_minibatches.*True"),
                          (dict(microbatch_size=0), "algo.microbatch_size.*0"),
                          (dict(mode="asynchronous"), "algo.mode.*'asynchronous'"),
                          (dict(max_staleness=-1), "algo.max_staleness.*-1"),
                          (dict(scale_rewards="rows"), "algo.scale_rewards.*'rows'"),
                          (dict(logprob_chunk_size=0), "algo.logprob_chunk_size.*0"),
                          (dict(overlong_buffer=-1), "algo.overlong_buffer.*-1"),
                          (dict(entropy_decay_start=-1), "algo.entropy_decay_start.*-1"),
                          (dict(entropy_decay_steps=0), "algo.entropy_decay_steps.*0"),
                          (dict(entropy_decay_start=5),
                           "algo.entropy_decay_start must be None when algo.loss.entropy_coef "
                           "is 0.*got 5"),
                          (dict(entropy_decay_start=5, loss=PolicyLossConfig(
                              entropy_coef=0.1, entropy_target=0.5)),
                           "algo.entropy_decay_start must be None when algo.loss.entropy_target"
                           )):
        with pytest.raises(ValueError, match=match):
            AlgoSection(**kwargs)
    with pytest.raises(ValueError, match="num_minibatches=3 must divide the 16 rows"):
        AlgoSection(num_minibatches=3).batch_split(16)
    with pytest.raises(ValueError, match="microbatch_size=3 must divide the 8 rows"):
        AlgoSection(num_minibatches=2, microbatch_size=3).batch_split(16)


@pytest.mark.parametrize("field, value, extra", [
    ("lr", 0.0, {}),
    ("lr", -1e-3, {}),
    ("lr", float("nan"), {}),
    ("warmup_steps", -1, {}),
    ("warmup_steps", 2.5, {}),
    ("total_steps", 10, {"warmup_steps": 10}),
    ("total_steps", 0, {}),
    ("min_lr_ratio", 1.5, {}),
    ("min_lr_ratio", -0.1, {}),
    ("b1", 1.0, {}),
    ("b2", -0.5, {}),
    ("eps", 0.0, {}),
    ("weight_decay", -0.01, {}),
    ("max_grad_norm", 0.0, {}),
])
def test_bad_values_raise_naming_the_field(field, value, extra):
    with pytest.raises(ValueError, match=rf"optim\.{field} must be .*got {value!r}"):
        OptimSection(**{field: value, **extra})


def test_loads_as_a_config_section():
    cfg = load_config(OptimSection, None, ["lr=3e-4", "total_steps=100", "max_grad_norm=null"])
    assert cfg == OptimSection(lr=3e-4, total_steps=100, max_grad_norm=None)
    with pytest.raises(ConfigError, match=r"optim\.b2 must be in \[0, 1\), got 1\.5"):
        load_config(OptimSection, None, ["b2=1.5"])


def test_auto_logprob_chunk_is_whole_logits_up_to_16384_columns_then_chunks_of_16384():
    assert resolve_logprob_chunk("auto", 4096) is None
    assert resolve_logprob_chunk("auto", 16_384) is None
    assert resolve_logprob_chunk("auto", 151_936) == 16_384
    assert resolve_logprob_chunk(128, 4096) == 128
    assert resolve_logprob_chunk(4096, 4096) is None  # a chunk of the whole vocabulary
    assert resolve_logprob_chunk(None, 151_936) is None


@pytest.mark.parametrize("field, value, requirement", [
    ("kind", "shared", "one of"),
    ("gamma", 1.5, r"a number in \[0, 1\]"),
    ("lam", -0.1, r"a number in \[0, 1\]"),
    ("value_clip", 0.0, "a finite number > 0, or None"),
    ("vf_coef", 0.0, "a finite number > 0"),
    ("warmup_steps", -1, "an integer >= 0"),
    ("warmup_steps", 1.5, "an integer >= 0"),
    ("whiten_advantages", "yes", "a bool"),
    ("lr", float("inf"), "a finite number > 0, or None"),
])
def test_bad_critic_values_name_the_key(field, value, requirement):
    with pytest.raises(ValueError, match=rf"algo\.critic\.{field} must be {requirement}.*got "
                                         rf"{value!r}"):
        CriticSection(**{field: value})


def test_gae_loads_with_its_critic_and_is_refused_in_async_mode():
    cfg = load_config(AlgoSection, None, ["advantage=gae", "critic.kind=value_head",
                                          "critic.lam=1.0", "critic.value_clip=null"])
    assert cfg.advantage == "gae"
    assert cfg.critic == CriticSection(kind="value_head", lam=1.0, value_clip=None)
    with pytest.raises(ValueError, match=r"algo\.advantage must be 'grpo', 'rloo' or 'dr_grpo' "
                                         r"with algo\.mode=async.*got 'gae'"):
        AlgoSection(advantage="gae", mode="async")
    with pytest.raises(ConfigError, match=r"critic\.kind.*'both'.*'separate', 'value_head'"):
        load_config(AlgoSection, None, ["critic.kind=both"])


def test_loss_variants_load_from_dotted_overrides():
    cfg = load_config(AlgoSection, None, [
        "loss.surrogate=cispo", "loss.cispo_ratio_cap=4.0", "loss.kl_estimator=k3_ratio",
        "loss.beta=0.01", "loss.entropy_aggregation=tokens", "loss.top_entropy_quantile=0.2",
        "loss.off_policy_kl_threshold=0.5", "loss.aggregation=seq_mean_token_sum"])
    assert (cfg.loss.surrogate, cfg.loss.kl_estimator, cfg.loss.off_policy_kl_threshold) == (
        "cispo", "k3_ratio", 0.5)
    with pytest.raises(ConfigError, match="surrogate"):
        load_config(AlgoSection, None, ["loss.surrogate=ppo"])
