"""Verifiable tasks: a prompt generator, the target each prompt has, and a reward to check it."""
