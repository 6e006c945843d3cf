"""Evaluation as a hook: every `eval.every` steps before the last (the run's end evaluates
the final policy itself), on held-out prompts, with the step's record made first; the result
goes to the metrics log and the run's evaluation file (`jaxrl.run.evaluate`)."""

from __future__ import annotations

from jaxrl.config.sampling import EvalSection
from jaxrl.run.build import policy
from jaxrl.run.evaluate import Evaluator, append_eval
from jaxrl.run.trainer import Hook, Trainer, every


class EvaluationHook(Hook):
    needs_record = True

    def __init__(self, config: EvalSection, max_steps: int):
        self.config, self.max_steps = config, max_steps
        self.evaluator: Evaluator | None = None  # made at the first evaluation

    def due(self, trainer: Trainer, done: int) -> bool:
        return (every(self.config.every, done) and done < self.max_steps
                and self.config.num_prompts > 0 and trainer.run.task.eval_rows is not None)

    def after_step(self, trainer: Trainer, done: int) -> None:
        run = trainer.run
        self.evaluator = self.evaluator or Evaluator(run, self.config)
        result = self.evaluator(policy(run.step, trainer.state)[1])
        trainer.recorder.log.write_scalars(done, result)
        append_eval(run.run_dir, done, result)
