"""Prompt data: tokenizer glue (datasets-based pipelines and tasks arrive with the RL core)."""
