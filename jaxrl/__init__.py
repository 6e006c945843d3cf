"""jaxrl: RL post-training of language models, generation and training in one XLA program."""

__version__ = "0.1.0"
