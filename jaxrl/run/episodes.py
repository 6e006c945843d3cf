"""A multi-turn run's pieces from its config: the environment of each sample, the turn limits.

    spec = env_spec(cfg, task)                    data.env, else the task's own; None: one turn
                                                  (the run's mode: `jaxrl.config.plan`)
    episodes = make_episodes(cfg, spec, task, tokenizer, eos_ids)

A turn ends at an EOS id, at `rollout.stop_token_ids`, or at an end tag of the tool format
(`</call>`, Qwen's `</tool_call>`, Llama's `<|eom_id|>`), which must each be one token of
the tokenizer: the rollout stops a slot on a token id.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.prompts import PromptSource
from jaxrl.data.tasks.task import Task
from jaxrl.data.tokenizer import pad_token_id
from jaxrl.envs.base import EnvFailure
from jaxrl.envs.registry import resolve_env
from jaxrl.envs.sandbox import SandboxUnavailable
from jaxrl.envs.tool_calls import format_for, make_format
from jaxrl.envs.tool_env import build_tools
from jaxrl.envs.tools import tool_schema
from jaxrl.envs.tools_config import ToolsConfig
from jaxrl.rl.rewards import JaxReward
from jaxrl.rollout.settings import Generation
from jaxrl.step.multiturn import Episodes, env_reward, make_environment
from jaxrl.step.multiturn_config import MultiTurnConfig

TOOLS_ENV = "tools"


def env_spec(cfg: ExperimentConfig, task: Task) -> str | None:
    """The environment of the run: `data.env`, else the task's own; None: single-turn. A
    `rollout.max_turns` above 1 without one is a ConfigError."""
    spec = cfg.data.env or task.env
    if spec is None and cfg.rollout.max_turns > 1:
        raise ConfigError(f"rollout.max_turns={cfg.rollout.max_turns} needs an environment to "
                          f"answer the turns: set data.env (a registered name like "
                          f"{TOOLS_ENV!r}, or \"module:attribute\"); data.task={task.name} has "
                          f"none of its own")
    return spec


def prompt_tools(cfg: ExperimentConfig, spec: str | None) -> tuple[dict, ...] | None:
    """The tool environment's function schemas for the prompts' chat template; None for
    another environment or none. Builds the tools, so a python tool without its sandbox
    program stops the run here (ConfigError), before any model loads."""
    if spec != TOOLS_ENV:
        return None
    try:
        tools = build_tools(cfg.data.tools)
    except SandboxUnavailable as e:
        raise ConfigError(f"data.tools.names={list(cfg.data.tools.names)} includes python: {e}; "
                          f"or set data.tools.python_sandbox=guard (an in-process guard, no "
                          f"security boundary)") from None
    return tuple(tool_schema(tool) for tool in tools)


def end_tag_ids(spec: str, tools: ToolsConfig, tokenizer: PreTrainedTokenizerBase
                ) -> tuple[int, ...]:
    """The token ids of the tool format's end tags (none for an environment of the user's)."""
    if spec != TOOLS_ENV:
        return ()
    fmt = format_for(tokenizer) if tools.format == "auto" else make_format(tools.format)
    ids = []
    for tag in fmt.end_tags:
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(f"the tool call format's end tag {tag!r} is {len(encoded)} tokens "
                              f"of this tokenizer ({encoded}); a turn stops on one token: choose "
                              f"data.tools.format for the model's chat template, or add the tag "
                              f"to the tokenizer as a token")
        ids.append(encoded[0])
    return tuple(ids)


def env_rewards(spec: str, task: Task) -> list[JaxReward]:
    """The environment's own reward as the JAX reward "env" for an environment named by
    `data.env` other than the tool environment (tools give no reward); none otherwise."""
    if spec == TOOLS_ENV or spec == task.env:
        return []
    return [JaxReward("env", env_reward)]


def make_episodes(cfg: ExperimentConfig, spec: str, task: Task,
                  tokenizer: PreTrainedTokenizerBase, eos_ids: tuple[int, ...],
                  vocab_size: int | None = None) -> Episodes:
    """The environments and turn limits of the run's multi-turn rollout. With the policy's
    `vocab_size`, the ids that end a turn or an episode must be inside its vocabulary (a
    ConfigError before step 0 otherwise; an observation's ids past it are counted during
    the steps, `jaxrl.step.multiturn_rollout`)."""
    tools = cfg.data.tools
    try:
        builder = resolve_env(spec)
    except ValueError as e:
        raise ConfigError(f"data.env={spec!r}: {e}") from None
    try:
        make_env = builder(tools, tokenizer)
    except Exception as e:  # the user's builder: named, exit 2 (nothing has run yet)
        raise ConfigError(f"data.env={spec!r}: the builder raised {type(e).__name__}: {e}; "
                          f"expected build(tools_config, tokenizer) -> factory") from None
    if not callable(make_env):
        raise ConfigError(f"data.env={spec!r}: the builder returned a "
                          f"{type(make_env).__name__}, not a factory row -> Environment")
    rows = RowView(task.train_rows)
    try:  # the factory on the first row, so one that always fails stops the run before step 0
        make_environment(make_env, rows, 0, spec=spec)
    except EnvFailure as e:
        raise ConfigError(str(e)) from None
    config = multiturn_config(cfg, end_tag_ids(spec, tools, tokenizer), eos_ids,
                              pad_token_id(tokenizer))
    outside = sorted({i for i in (*config.turn_end_token_ids, *config.eos_token_ids)
                      if vocab_size is not None and not 0 <= i < vocab_size})
    if outside:
        raise ConfigError(
            f"data.env={spec!r}: the token ids that end a turn or an episode (the tool "
            f"format's end tags, rollout.stop_token_ids, EOS) include {outside}, outside the "
            f"policy's vocabulary [0, {vocab_size}): the policy could never sample them; use "
            f"a tokenizer that matches model.path, or other rollout.stop_token_ids")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    return Episodes(make_env, rows, encode, decode, config, spec)


def multiturn_config(cfg: ExperimentConfig, end_tags: tuple[int, ...],
                     eos_ids: tuple[int, ...], pad_id: int) -> MultiTurnConfig:
    """The run's multi-turn rollout settings: the rollout section's limits and engine, a turn
    ending at the tool format's `end_tags` or `rollout.stop_token_ids`, an episode at the
    `eos_ids` (none with `rollout.ignore_eos`), every row of a batch in a slot unless
    `rollout.engine.max_slots` says fewer."""
    r = cfg.rollout
    b = cfg.data.batch_size * r.num_generations
    return MultiTurnConfig(
        Generation.of(r), num_slots=min(r.engine.max_slots or b, b),
        turn_end_token_ids=tuple(dict.fromkeys((*end_tags, *r.stop_token_ids))),
        eos_token_ids=() if r.ignore_eos else tuple(eos_ids), pad_token_id=pad_id,
        env_timeout_s=cfg.data.env_timeout_s)


def task_prompts(cfg: ExperimentConfig, task: Task, rows, spec: str | None, *, batch_size: int,
                 seed: int) -> PromptSource:
    """The task's `rows` as the run's prompts (training's and evaluation's alike): its
    fields carried along, rendered and limited as `data` says, with the tool schemas of the
    run's environment `spec` in the chat template."""
    return PromptSource(rows, prompt_column="prompt", field_columns=task.field_columns,
                        chat_template=cfg.data.chat_template,
                        max_prompt_len=cfg.data.max_prompt_len, batch_size=batch_size,
                        seed=seed, tools=prompt_tools(cfg, spec))


class RowView:
    """Dataset rows by index, each a plain dict (what an environment factory receives)."""

    def __init__(self, rows):
        self._rows = rows

    def __getitem__(self, i: int) -> dict:
        return dict(self._rows[int(i)])

    def __len__(self) -> int:
        return len(self._rows)
