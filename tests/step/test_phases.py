"""`prompt_group`: how many rows of a microbatch share one prompt's forward, by hand."""

import dataclasses

import pytest

from jaxrl.config import AlgoSection
from jaxrl.step.forward import prompt_group
from tests.conftest import make_tiny_config

XLA = make_tiny_config("llama")  # attention_impl "xla"


@pytest.mark.parametrize("group_size,rows,slices,shards,expected", [
    (8, 64, 1, 1, 8),  # one microbatch: a whole group per prompt
    (8, 64, 2, 1, 4),  # slice i of 2 holds rows i, i + 2, ...: 4 of every prompt
    (8, 64, 8, 1, 1),  # one row of each prompt per slice: nothing to share
    (6, 48, 4, 1, 1),  # 4 does not divide G: the slices hold 2, 2, 1, 1 rows of a prompt
    (8, 64, 1, 4, 8),  # 8 prompts over 4 devices: 2 each
    (8, 64, 1, 16, 4),  # 8 prompts over 16 devices would leave some without one: 16 of 4
    (8, 64, 2, 16, 2),  # 32 rows a slice over 16 devices: 16 prompts of 2 rows
    (4, 4, 1, 8, 1),  # 4 rows over 8 devices: no prompt count divides
])
def test_rows_sharing_a_prompt_per_microbatch(group_size, rows, slices, shards, expected):
    assert prompt_group(AlgoSection(), XLA, group_size, rows, slices, shards) == expected


def test_sharing_is_off_when_switched_off_or_under_an_attention_kernel():
    assert prompt_group(AlgoSection(share_prompts=False), XLA, 8, 64, 1) == 1
    for kernel in ("cudnn", "splash"):
        assert prompt_group(AlgoSection(), dataclasses.replace(XLA, attention_impl=kernel),
                            8, 64, 1) == 1


def test_share_prompts_must_be_a_bool():
    with pytest.raises(ValueError, match="algo.share_prompts.*a bool"):
        AlgoSection(share_prompts="yes")
