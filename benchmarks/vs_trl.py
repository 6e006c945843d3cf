"""jaxrl vs TRL: the same GRPO workload on this machine's CPU, one library after the other.

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py [--workload fixed|longtail] [--rounds N] [--warmup 2]
        [--steps 5] [--work-dir DIR] [--only jaxrl|trl] [--jaxrl-set KEY=VALUE ...]
        [--jaxrl-checkout PATH]

Workload (made here, nothing is downloaded; everything is seeded):
- policy: a random-init Qwen2 (transformers `Qwen2ForCausalLM`), hidden 256, 4 layers, 4
  heads / 2 KV heads, intermediate 768, vocabulary 4096, tied embeddings, float32 (4.2M
  parameters), saved in HF format with its tokenizer: a `tokenizers` WordLevel tokenizer of
  exactly 4096 tokens (every word of the prompts, then filler words) saved as a
  `PreTrainedTokenizerFast`, so both libraries load the same directory;
- prompts: templated GSM8K-style word problems (`prompts.jsonl`, question/answer columns),
  each rendered by `jaxrl.data.tasks.gsm8k.render_question` to the same number of tokens;
- a step: 8 prompts x 8 generations, exactly 64 completion tokens each (EOS cannot end a
  completion), temperature 1, GRPO advantages scaled by the group std, clipped loss
  (epsilon 0.2) averaged over all tokens of the batch, beta 0 (no reference model), one
  AdamW update of all 64 completions (lr 1e-5 constant, betas 0.9/0.999, eps 1e-8, no weight
  decay, gradient norm clipped at 1); reward: `jaxrl.data.tasks.gsm8k.math_reward`
  (math-verify) on both sides;
- timing: `--warmup` steps, then `--steps` measured steps; tokens/s is the median over the
  measured steps of (completion tokens generated in the step / step seconds).

Each library runs in its own subprocess, back to back, so neither's threads or memory touch
the other. jaxrl runs `jaxrl bench` (the last stdout line is its JSON) on a config written
here: one CPU device (`sharding.layout=single`), the fused step (the Python reward through a
host callback), `algo.num_minibatches=1`, `rollout.ignore_eos=true`, no chat template.
TRL 1.16 runs `GRPOTrainer` on torch (CPU, no vLLM, float32, gradient checkpointing off,
`per_device_train_batch_size=64` and no accumulation, so a trainer step is one generation
of 64 completions and one update), with `min_new_tokens=64`, and torch set to
`os.cpu_count()` threads; a TrainerCallback times on_step_begin -> on_step_end and the reward
function counts the completion tokens of each step.

Equal on both sides: weights, tokenizer, prompts and their token length, group size, number
of completion tokens, sampling temperature, loss, optimizer settings, reward function.
Not equal: the random streams (the sampled tokens, hence the reward values, differ; with a
random policy the reward is almost always 0 on both sides, so the gradient carries little
signal, but both do the full forward and backward); jaxrl's trainer runs each prompt once
for its 8 rows (`algo.share_prompts`, its default: the same numbers, 32 of the 96 positions
of a row computed once per group), TRL once per row; neither runs a no-grad forward for the
old log-probs, since one generation feeds one update (jaxrl: old = stop_gradient(new));
jaxrl's step is one compiled program (compiled ahead of time, before the warm-up: `compile_s`
in its JSON), TRL runs eagerly; TRL tokenizes a step's prompts inside the timed step, jaxrl's
`bench` before it (a few ms). jaxrl's MFU is against the float32 matmul rate JAX measures on
this host (`peak_source`); TRL's "train" column is the step minus its `generate` call.

`--workload longtail` (`longtail_policy.py`): completions end at EOS with long-tailed lengths,
the same distribution in both libraries because it is a property of the weights. The policy is
the same Qwen2 with an untied lm_head (5.2M parameters, the same FLOPs per token), its weights
made a Markov chain over token classes: a quarter of the rows never emit EOS and run to the
cap of 256 tokens (`rollout.max_new_tokens=256`, TRL `max_completion_length=256`), the others
stop at EOS after a geometric number of tokens, so the median length is 20 and the mean 78.
Both libraries stop at EOS (no `ignore_eos`, no `min_new_tokens`). Its completions hold only
filler words, so `math_reward` is 0 on every one: all advantages are 0 and the weights (hence
the distribution) stay exactly as made over the measured steps. Each library's completion
lengths are counted from what it returns (TRL: the reward's `completion_ids`; jaxrl: its
reward, run as `data.reward_fn=longtail_policy:math_reward`, counts each completion's words)
and printed with the chain's own median, mean and fraction at the cap.

`--rounds N` runs the two libraries N times, alternating which goes first (round 1 jaxrl
then TRL, round 2 TRL then jaxrl, ...), and prints every round and its jaxrl / TRL ratio.
`--jaxrl-set KEY=VALUE` (repeatable) adds a dotted override to jaxrl's config;
`--jaxrl-checkout PATH` runs jaxrl from another source tree (its `jaxrl` package first on
PYTHONPATH, the subprocess started in PATH): a setting or an older commit raced in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import longtail_policy as longtail
import vs_trl_report as report

PROMPTS_PER_STEP, GENERATIONS, COMPLETION_TOKENS = 8, 8, 64
ROWS = PROMPTS_PER_STEP * GENERATIONS
NUM_PROMPTS = 256  # enough distinct prompts for every step of a run
LR, SEED, VOCAB = 1e-5, 0, 4096
EOS, PAD, UNK = "<|endoftext|>", "<|pad|>", "<unk>"
NAMES = ["Tom", "Ana", "Raj", "Mei", "Olu", "Ivan", "Sara", "Kofi"]
ITEMS = ["apples", "books", "coins", "stamps", "pencils", "marbles", "cards", "shells"]
WORKLOADS = ("fixed", "longtail")


# ---------------------------------------------------------------- the workload files
def write_prompts(path: Path) -> list[str]:
    """NUM_PROMPTS templated word problems as jsonl (question, answer "#### N"); their texts."""
    rng = random.Random(SEED)
    rows = []
    for _ in range(NUM_PROMPTS):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append({"question": f"{name} has {a} {item} and buys {b} more. "
                                 f"How many {item} does {name} have now?",
                     "answer": f"{name} has {a} + {b} = {a + b} {item}.\n#### {a + b}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["question"] for r in rows]


def make_tokenizer(texts: list[str]):
    """A WordLevel tokenizer of exactly VOCAB tokens: specials, the texts' words, fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)}
                   | {str(n) for n in range(1000)})
    vocab = {tok: i for i, tok in enumerate([EOS, PAD, UNK, *words])}
    filler = 0
    while len(vocab) < VOCAB:
        vocab.setdefault(f"w{filler}", len(vocab))
        filler += 1
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = split
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD,
                                        unk_token=UNK)
    assert len(tokenizer) == VOCAB, len(tokenizer)
    return tokenizer


def qwen2_config(tokenizer, *, tied: bool, **sizes):
    """The workload's Qwen2 config (hidden 256, 4 layers, ...; `sizes` overrides, for tests)."""
    from transformers import Qwen2Config

    shape = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 768, **sizes}
    return Qwen2Config(
        vocab_size=VOCAB, **shape, max_position_embeddings=512, tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, dtype="float32")


def make_workload(work: Path, kind: str) -> dict:
    """Writes model/ (random Qwen2, or the long-tail chain, + tokenizer) and prompts.jsonl;
    returns their description."""
    import torch
    from transformers import Qwen2ForCausalLM

    from jaxrl.data.tasks.gsm8k import render_question

    questions = write_prompts(work / "prompts.jsonl")
    rendered = [render_question(q) for q in questions]
    tokenizer = make_tokenizer(rendered)
    lengths = {len(tokenizer(t)["input_ids"]) for t in rendered}
    assert len(lengths) == 1, f"prompts of different token lengths: {sorted(lengths)}"
    assert tokenizer.unk_token_id not in tokenizer(rendered[0])["input_ids"]
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, tied=kind == "fixed")).float()
    if kind == "longtail":
        longtail.make_markov(model, tokenizer)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    out = {"model_dir": str(work / "model"), "prompts": str(work / "prompts.jsonl"),
           "prompt_tokens": lengths.pop(),
           "parameters": sum(p.numel() for p in model.parameters())}
    if kind == "longtail":
        out["expected_lengths"] = longtail.expected_stats()
    return out


# ---------------------------------------------------------------- jaxrl half
def jaxrl_config(work: Path, workload: dict, steps_total: int, kind: str) -> Path:
    """The jaxrl experiment config of the workload (YAML in the work dir)."""
    import yaml

    rollout = {"num_generations": GENERATIONS, "max_new_tokens": COMPLETION_TOKENS,
               "temperature": 1.0, "ignore_eos": True}
    data = {"task": "gsm8k", "source": workload["prompts"], "prompt_column": "question",
            "answer_column": "answer", "chat_template": False,
            "max_prompt_len": workload["prompt_tokens"], "batch_size": PROMPTS_PER_STEP}
    if kind == "longtail":  # stop at EOS; the same reward, which also counts the lengths
        rollout = {"num_generations": GENERATIONS, "max_new_tokens": longtail.CAP,
                   "temperature": 1.0}
        data["reward_fn"] = "longtail_policy:math_reward"
    cfg = {
        "model": {"path": workload["model_dir"], "dtype": "float32"},
        "sharding": {"layout": "single"},
        "rollout": rollout,
        "algo": {"mode": "fused", "advantage": "grpo", "scale_rewards": "group",
                 "num_iterations": 1, "num_minibatches": 1,
                 "loss": {"epsilon_low": 0.2, "epsilon_high": 0.2,
                          "aggregation": "token_mean", "beta": 0.0}},
        "optim": {"lr": LR, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                  "max_grad_norm": 1.0},
        "data": data,
        "train": {"max_steps": steps_total, "seed": SEED, "save_final": False},
        "eval": {"num_prompts": 0},
        "log": {"tensorboard": False, "plot": False},
    }
    path = work / "jaxrl_vs_trl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_jaxrl(work: Path, workload: dict, warmup: int, steps: int, kind: str, *,
              run_name: str = "jaxrl_run", overrides: tuple[str, ...] = (),
              checkout: Path | None = None) -> dict:
    """`jaxrl bench` in a subprocess (from `checkout` when given); its last stdout line (JSON)."""
    from jaxrl.saved.files import METRICS_FILE

    config = jaxrl_config(work, workload, warmup + steps, kind)
    run_dir = work / run_name
    shutil.rmtree(run_dir, ignore_errors=True)  # a jaxrl run directory is never reused
    cmd = [sys.executable, "-m", "jaxrl.cli", "bench", str(config), f"train.run_dir={run_dir}",
           *overrides, "--steps", str(steps), "--warmup", str(warmup)]
    env, cwd, path = dict(os.environ), None, []
    if checkout is not None:  # `python -m` puts the working directory first on sys.path
        path, cwd = [str(checkout)], checkout
    lengths_file = work / f"{run_name}_lengths.txt"
    if kind == "longtail":  # longtail_policy:math_reward appends each completion's length
        path.append(str(Path(__file__).resolve().parent))
        env[longtail.LENGTHS_ENV] = str(lengths_file)
        lengths_file.unlink(missing_ok=True)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    source = _jaxrl_source(env, cwd, checkout) if checkout is not None else None
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    result = _last_json_line(subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                            cwd=cwd), "jaxrl")
    # The bench JSON's tokens_per_s is total tokens / total seconds; for the same statistic as
    # the TRL half, take the median of the measured steps' rates from its metrics.jsonl.
    lines = (Path(result["run_dir"]) / METRICS_FILE).read_text().splitlines()
    measured = [r for r in map(json.loads, lines) if r["step"] >= warmup]
    if kind == "fixed":
        assert all(r["completion/len_mean"] == COMPLETION_TOKENS for r in measured), measured
    else:
        result.update(_jaxrl_lengths(lengths_file, measured, warmup, steps))
    result["bench_tokens_per_s"] = result["tokens_per_s"]
    result["tokens_per_s"] = statistics.median(r["perf/tokens_per_s"] for r in measured)
    if source is not None:
        result["jaxrl_source"] = source
    return result


def _jaxrl_source(env: dict, cwd: Path, checkout: Path) -> dict:
    """Where the subprocess's `jaxrl` comes from (it must be `checkout`'s) and its commit."""
    origin = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('jaxrl')"
                               ".origin)"], env=env, cwd=cwd, capture_output=True, text=True,
        check=True).stdout.strip()
    if not Path(origin).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"--jaxrl-checkout {checkout}: the subprocess imports jaxrl from "
                         f"{origin}")
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"path": str(checkout), "origin": origin, "commit": commit or None}


def _jaxrl_lengths(path: Path, measured: list[dict], warmup: int, steps: int) -> dict:
    """The measured steps' completion lengths, as jaxrl's reward counted them; each step's
    mean checked against the step's own completion/len_mean."""
    lengths = [int(n) for n in path.read_text().split()]
    assert len(lengths) == (warmup + steps) * ROWS, (len(lengths), warmup + steps)
    per_step = [lengths[i * ROWS:(i + 1) * ROWS] for i in range(warmup, warmup + steps)]
    for rows, r in zip(per_step, measured, strict=True):
        assert abs(statistics.fmean(rows) - r["completion/len_mean"]) < 1e-3, (rows, r)
    return {"lengths": longtail.length_stats([n for rows in per_step for n in rows]),
            "tokens_per_step": [sum(rows) for rows in per_step]}


# ---------------------------------------------------------------- TRL half
def trl_worker(work: Path, warmup: int, steps: int, kind: str) -> dict:
    """GRPOTrainer on the workload, in this (child) process; per-step times and tokens."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl.data.tasks.gsm8k import math_reward, render_question

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(SEED)
    model_dir = work / "model"
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = datasets.load_dataset("json", data_files=str(work / "prompts.jsonl"), split="train")
    rows = rows.map(lambda r: {"prompt": render_question(r["question"])})

    lengths_now = []  # completion lengths of the step in progress (the reward sees them all)

    def math(prompts, completions, completion_ids, answer, **_):
        lengths_now.extend(len(ids) for ids in completion_ids)
        return [math_reward(p, c, {"answer": a})
                for p, c, a in zip(prompts, completions, answer, strict=True)]

    records, step_lengths = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **_):
            lengths_now.clear()
            self.gen_s, self.t0 = 0.0, time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            records.append({"step_s": time.perf_counter() - self.t0, "tokens": sum(lengths_now),
                            "generate_s": timer.gen_s})
            step_lengths.append(list(lengths_now))

    timer = StepTimer()

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            timer.gen_s += time.perf_counter() - t0
            return out

    fixed = kind == "fixed"  # else stop at EOS, up to the long-tail cap
    args = GRPOConfig(
        output_dir=str(work / "trl_out"), use_cpu=True, bf16=False, seed=SEED,
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=1, num_generations=GENERATIONS, num_iterations=1,
        max_completion_length=COMPLETION_TOKENS if fixed else longtail.CAP,
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS} if fixed else None,
        temperature=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        gradient_checkpointing=False, use_vllm=False, max_steps=warmup + steps,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[math], args=args, train_dataset=rows,
                               processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    measured = records[warmup:]
    if fixed:
        assert all(r["tokens"] == ROWS * COMPLETION_TOKENS for r in measured), \
            [r["tokens"] for r in measured]
    out = {"tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in measured),
           "step_s": statistics.median(r["step_s"] for r in measured),
           "generate_s": statistics.median(r["generate_s"] for r in measured),
           "train_s": statistics.median(r["step_s"] - r["generate_s"] for r in measured),
           "tokens_per_step": measured[0]["tokens"] if fixed else [r["tokens"] for r in measured],
           "torch_threads": torch.get_num_threads(), "steps": measured}
    if not fixed:
        out["lengths"] = longtail.length_stats([n for ls in step_lengths[warmup:] for n in ls])
    return out


def run_trl(work: Path, warmup: int, steps: int, kind: str) -> dict:
    """`trl_worker` in a subprocess (this script, `--child trl`); its last stdout line."""
    cmd = [sys.executable, __file__, "--child", "trl", "--work-dir", str(work),
           "--warmup", str(warmup), "--steps", str(steps), "--workload", kind]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return _last_json_line(subprocess.run(cmd, stdout=subprocess.PIPE, text=True), "TRL")


def _last_json_line(proc: subprocess.CompletedProcess, who: str) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout)
        raise SystemExit(f"the {who} half failed (exit {proc.returncode})")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed",
                        help="fixed: 64 tokens per completion; longtail: stop at EOS, "
                             "long-tailed lengths up to 256 (module docstring)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run both libraries N times, alternating which goes first")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before timing")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--work-dir", type=Path, help="default: a fresh temporary directory")
    parser.add_argument("--only", choices=("jaxrl", "trl"), help="run one half only")
    parser.add_argument("--jaxrl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted override of jaxrl's config (repeatable)")
    parser.add_argument("--jaxrl-checkout", type=Path, metavar="PATH",
                        help="run jaxrl from this source tree (e.g. a worktree of another "
                             "commit)")
    parser.add_argument("--baseline-checkout", type=Path, metavar="PATH",
                        help="also race jaxrl from this source tree in every round, as "
                             "'jaxrl-before' (a 'before' commit in the same sitting)")
    parser.add_argument("--child", choices=("trl",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(trl_worker(args.work_dir, args.warmup, args.steps, args.workload)))
        return
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if any("=" not in kv for kv in args.jaxrl_set):
        parser.error(f"--jaxrl-set takes KEY=VALUE, got {args.jaxrl_set}")
    for flag, tree in (("--jaxrl-checkout", args.jaxrl_checkout),
                       ("--baseline-checkout", args.baseline_checkout)):
        if tree is not None and not (tree / "jaxrl").is_dir():
            parser.error(f"{flag} {tree} has no jaxrl/ package")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="jaxrl_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    workload = make_workload(work, args.workload)
    print(f"work dir {work}: {workload['parameters'] / 1e6:.2f}M parameters, prompts of "
          f"{workload['prompt_tokens']} tokens", file=sys.stderr, flush=True)
    names = [name for name in ("jaxrl", "TRL") if args.only in (None, name.lower())]
    if args.baseline_checkout is not None:
        names.insert(1, "jaxrl-before")
    rounds = []
    for i in range(args.rounds):
        results = {}
        for name in names if i % 2 == 0 else names[::-1]:
            if name.startswith("jaxrl"):
                before = name == "jaxrl-before"
                run_name = "jaxrl_before_run" if before else "jaxrl_run"
                results[name] = run_jaxrl(
                    work, workload, args.warmup, args.steps, args.workload,
                    run_name=run_name if args.rounds == 1 else f"{run_name}_{i + 1}",
                    overrides=tuple(args.jaxrl_set),
                    checkout=args.baseline_checkout if before else args.jaxrl_checkout)
            else:
                results[name] = run_trl(work, args.warmup, args.steps, args.workload)
        rounds.append(results)

    shape = ({"completion_tokens": COMPLETION_TOKENS} if args.workload == "fixed"
             else {"kind": args.workload, "max_completion_tokens": longtail.CAP})
    report.print_report(rounds, report.summary(
        rounds, {"prompts_per_step": PROMPTS_PER_STEP, "generations": GENERATIONS, **shape,
                 **workload}, warmup=args.warmup, steps=args.steps, jaxrl_set=args.jaxrl_set,
        jaxrl_checkout=args.jaxrl_checkout and str(args.jaxrl_checkout),
        baseline_checkout=args.baseline_checkout and str(args.baseline_checkout)), ROWS)

if __name__ == "__main__":
    main()
