"""Seeded bugs: proof that the fast test tier still catches real mistakes in jaxrl's core.

Each entry of BUGS is a one-line change to a file of jaxrl/ (a sign flipped, an off-by-one,
a wrong axis, a wrong mask, a missing term, a wrong comparison) and the fast-tier tests that
must catch it. For each bug this script copies the tracked files of the tree (`git ls-files`,
as they are on disk: no .git, .venv or runs/) into a fresh temporary folder, applies the
change there (the original text must occur exactly once in the file), and runs

    python -m pytest -q -p no:cacheprovider -p no:xdist -x <the bug's tests>

in that copy, with the copy first on PYTHONPATH (so the copy's jaxrl is imported, not the
editable install's: checked in every copy). A bug is caught when one of its tests FAILED
(pytest exit 1, the test named in its summary); anything else (a collection or import
error, an error in a fixture, no test run, a timeout) is not a catch. Before the bugs, every
test must be collected by the fast tier (no `process`, `learning` or `packaging` marker; none
of AVOID), and the union of all the tests runs once on an unchanged copy and must pass.
Prints one line per bug; exits 1 when the baseline fails or any bug is not caught.

    python tests/seeded_bugs.py                  # every bug (minutes: one pytest per bug)
    python tests/seeded_bugs.py --list           # the bugs, their lines and tests
    python tests/seeded_bugs.py --only gae-lambda rloo-denominator

Not collected by pytest (the file name does not start with test_); docs/testing.md
("Seeded bugs") has the table and the last measured run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Test modules a seeded bug may not depend on: whole trainings and CLI runs (slow, and their
# failures say little about which line broke), and the goldens.
AVOID = ("tests/commands/", "tests/run/test_env_failures.py", "tests/config/test_composition",
         "tests/test_docs.py", "tests/run/test_golden_metrics.py")
TIMEOUT_S = 900  # one pytest run (a bug that hangs a loop counts as not caught)


@dataclasses.dataclass(frozen=True)
class Bug:
    id: str
    file: str  # relative to the tree's root
    old: str  # must occur exactly once in `file`
    new: str
    breaks: str  # one sentence: what the change breaks
    tests: tuple[str, ...]  # fast-tier node ids that must fail


BUGS = (
    # ------------------------------------------------------------------ policy losses
    Bug("ppo-clip-max", "jaxrl/rl/loss_variants.py",
        "return -jnp.minimum(capped_BxT * adv_Bx1, clipped_BxT), metrics",
        "return -jnp.maximum(capped_BxT * adv_Bx1, clipped_BxT), metrics",
        "PPO's pessimistic min of the clipped and unclipped surrogates becomes a max.",
        ("tests/rl/test_losses.py::test_clipped_objective_by_hand",)),
    Bug("ppo-clip-epsilons-swapped", "jaxrl/rl/loss_variants.py",
        "jnp.clip(ratio_BxT, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)",
        "jnp.clip(ratio_BxT, 1 - cfg.epsilon_high, 1 + cfg.epsilon_low)",
        "DAPO's asymmetric clip range is applied the wrong way round.",
        ("tests/rl/test_losses.py::test_clipping_at_both_epsilons_stops_the_gradient_on_one_side_only",)),
    Bug("loss-logp-unmasked", "jaxrl/rl/losses.py",
        "    logp_BxT = tok.masked(logp_BxT)\n",
        "    logp_BxT = logp_BxT\n",
        "Padding log-probs enter the ratio unmasked: garbage there gives a NaN gradient.",
        ("tests/rl/test_losses.py::test_masked_tokens_have_exactly_zero_gradient",)),
    Bug("k3-sign", "jaxrl/rl/losses.py",
        "k3_BxT = jnp.expm1(log_r_BxT) - log_r_BxT",
        "k3_BxT = jnp.expm1(log_r_BxT) + log_r_BxT",
        "The k3 KL estimator r - 1 - log r loses its sign on log r (no longer >= 0, biased).",
        ("tests/rl/test_losses.py::test_kl_estimators_by_hand",)),
    Bug("gspo-no-length-norm", "jaxrl/rl/losses.py",
        "seq_log_ratio_B = jnp.sum(log_ratio_BxT, axis=1) / jnp.maximum(count_B, 1.0)",
        "seq_log_ratio_B = jnp.sum(log_ratio_BxT, axis=1)",
        "GSPO's sequence ratio is the product of the token ratios, not their geometric mean.",
        ("tests/rl/test_losses.py::test_gspo_ratio_is_the_geometric_mean_of_the_sequence",)),
    Bug("entropy-bonus-sign", "jaxrl/rl/losses.py",
        "return per_token_BxT - coef * entropy_BxT, 0.0",
        "return per_token_BxT + coef * entropy_BxT, 0.0",
        "The entropy bonus becomes an entropy penalty.",
        ("tests/rl/test_losses.py::test_entropy_bonus_lowers_the_loss_by_coef_times_entropy",)),
    Bug("mis-mask-inverted", "jaxrl/rl/losses.py",
        "return jnp.where(passed_BxT, 0.0, rho_BxT)",
        "return jnp.where(passed_BxT, rho_BxT, 0.0)",
        "Masked importance sampling keeps the tokens past the cap and drops the others.",
        ("tests/rl/test_losses.py::test_behaviour_corrections_by_hand[mis-2.0--0.25-0.25]",)),
    # ------------------------------------------------------------------ advantages
    Bug("grpo-population-std", "jaxrl/rl/advantages.py",
        "jnp.std(r_PxG, axis=1, ddof=1, keepdims=True)",
        "jnp.std(r_PxG, axis=1, ddof=0, keepdims=True)",
        "GRPO's group std is the population std, not TRL's sample std (ddof=1).",
        ("tests/rl/test_advantages.py::test_grpo_group_scale_uses_the_sample_std",)),
    Bug("rloo-denominator", "jaxrl/rl/advantages.py",
        "- r_PxG) / (group_size - 1)",
        "- r_PxG) / group_size",
        "RLOO's leave-one-out baseline divides the others' sum by G instead of G - 1.",
        ("tests/rl/test_advantages.py::test_rloo_subtracts_the_mean_of_the_others",)),
    Bug("dr-grpo-wrong-axis", "jaxrl/rl/advantages.py",
        "return (r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)).reshape(-1)",
        "return (r_PxG - jnp.mean(r_PxG, axis=0, keepdims=True)).reshape(-1)",
        "Dr. GRPO centres each reward on the mean over prompts instead of over its group.",
        ("tests/rl/test_advantages.py::test_grpo_no_scale_and_dr_grpo_are_the_centred_rewards",)),
    Bug("zero-std-tile", "jaxrl/rl/advantages.py",
        "return jnp.repeat(flat_P, group_size)",
        "return jnp.tile(flat_P, group_size)",
        "The zero-std group mask is laid out group-minor, masking the wrong rows.",
        ("tests/rl/test_advantages.py::test_zero_std_groups_are_masked_and_counted",)),
    # ------------------------------------------------------------------ GAE and the critic
    Bug("gae-lambda", "jaxrl/rl/gae.py",
        "adv_B = delta_B + gamma * lam * next_adv_B",
        "adv_B = delta_B + gamma * next_adv_B",
        "GAE drops lambda from its recursion (every lambda acts as 1).",
        ("tests/rl/test_gae.py::test_gae_by_hand",)),
    Bug("value-clip-min", "jaxrl/rl/gae.py",
        "per_token, clipped_larger = jnp.maximum(unclipped, clipped), clipped > unclipped",
        "per_token, clipped_larger = jnp.minimum(unclipped, clipped), clipped > unclipped",
        "The clipped value loss takes the smaller of the two errors instead of the larger.",
        ("tests/rl/test_gae.py::test_clipped_value_loss_by_hand",)),
    # ------------------------------------------------------------------ token log-probs
    Bug("logprob-sign", "jaxrl/rl/logprobs.py",
        "    return target_BxT - lse_BxT\n",
        "    return lse_BxT - target_BxT\n",
        "Token log-probs come out negated (positive), i.e. the loss climbs the wrong way.",
        ("tests/rl/test_logprobs.py::test_log_probs_and_entropy_by_hand",)),
    Bug("chunked-rescale", "jaxrl/rl/logprobs.py",
        "rescale_BxT = jnp.exp(m_BxT - m_new_BxT)",
        "rescale_BxT = jnp.exp(m_new_BxT - m_BxT)",
        "The online softmax rescales the running sums up instead of down when the max grows.",
        ("tests/rl/test_logprobs.py::test_chunked_equals_unchunked[7]",)),
    Bug("chunked-pad-column", "jaxrl/rl/logprobs.py",
        "valid_C = ids_C < vocab",
        "valid_C = ids_C <= vocab",
        "The first zero-padded vocabulary column counts as a real token (logit 0) in the sums.",
        ("tests/rl/test_logprobs.py::test_chunked_equals_unchunked[7]",)),
    # ------------------------------------------------------------------ packing
    Bug("packing-predictor-shift", "jaxrl/step/packing.py",
        "dest_BxT[:, p - 1:t - 1], 0)",
        "dest_BxT[:, p:t], 0)",
        "Each completion token is read from its own position instead of the one predicting it.",
        ("tests/step/test_packing.py::test_the_plan_places_every_real_token_once_in_order_and_no_row_straddles",)),
    Bug("packing-offset", "jaxrl/step/packing.py",
        "within_BxT = jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32) - 1",
        "within_BxT = jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32)",
        "Packed tokens land one place late, so a row's last token overwrites the next row's first.",
        ("tests/step/test_packing.py::test_the_plan_places_every_real_token_once_in_order_and_no_row_straddles",)),
    # ------------------------------------------------------------------ the slot engine
    Bug("slot-limit-off-by-one", "jaxrl/rollout/slots.py",
        "(index_S + 1 >= limit_S)",
        "(index_S >= limit_S)",
        "A row ends one token after its limit (max_new_tokens + 1 tokens).",
        ("tests/rollout/test_continuous.py::test_per_row_limits_truncate_each_row",)),
    Bug("pages-give-back-slot", "jaxrl/rollout/pages.py",
        "slot_N = free.count + jnp.cumsum(keep_N) - 1",
        "slot_N = free.count + jnp.cumsum(keep_N)",
        "Pages given back are pushed one place above the free stack's top: one is lost, one "
        "read as garbage.",
        ("tests/rollout/test_continuous.py::test_pages_are_given_back_and_reused",)),
    Bug("admit-pages-not-cumulative", "jaxrl/rollout/decode_loop.py",
        "(jnp.cumsum(need_K) <= state.free.count)",
        "(need_K <= state.free.count)",
        "Admission checks each waiting row's pages alone, not together: the pool is overdrawn.",
        ("tests/rollout/test_continuous.py::test_pages_are_given_back_and_reused",)),
    # ------------------------------------------------------------------ sharding rules
    Bug("rules-drop-leading-axis", "jaxrl/sharding/rules.py",
        "axes = axes[:-1]",
        "axes = axes[1:]",
        "A dimension the mesh axes do not divide drops its leading mesh axis, not the trailing one.",
        ("tests/sharding/test_rules.py::test_spec_worked_examples[mesh_shape2-axes2-shape2-expected2]",)),
    Bug("rules-axis-reused", "jaxrl/sharding/rules.py",
        "if a not in used and mesh.shape.get(a, 1) > 1)",
        "if mesh.shape.get(a, 1) > 1)",
        "A mesh axis may shard two dimensions of one array.",
        ("tests/sharding/test_rules.py::test_spec_never_uses_a_mesh_axis_twice_and_always_divides",)),
    # ------------------------------------------------------------------ memory fit
    Bug("memory-peak-sum", "jaxrl/perf/memory.py",
        "return max(p.peak_bytes for p in self.programs)",
        "return sum(p.peak_bytes for p in self.programs)",
        "The step's peak adds its programs' peaks although they run one after another.",
        ("tests/perf/test_memory.py::test_check_fit_under_a_big_limit",)),
    Bug("memory-alias-added", "jaxrl/perf/memory.py",
        "return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes",
        "return (self.argument_bytes + self.output_bytes + self.alias_bytes + self.temp_bytes",
        "Donated buffers count twice instead of once.",
        ("tests/perf/test_memory.py::test_donation_lowers_the_peak_by_the_aliased_bytes",)),
    # ------------------------------------------------------------------ checkpoint restore
    Bug("restore-oldest-first", "jaxrl/saved/checkpoint.py",
        "for candidate in reversed(steps):",
        "for candidate in steps:",
        "Resume reads the oldest checkpoint first, not the newest readable one.",
        ("tests/saved/test_checkpoint.py::test_a_damaged_newest_checkpoint_is_moved_aside_and_its_step_saved_again[garbled meta JSON]",)),
    # ------------------------------------------------------------------ plan refusals
    Bug("plan-multiturn-processes", "jaxrl/config/plan.py",
        "if processes > 1:",
        "if processes > 2:",
        "A multi-turn run on two processes is no longer refused.",
        ("tests/config/test_plan.py::test_multi_turn_refuses_what_it_cannot_run[overrides2-2-run in one process for now; this run has 2]",)),
    # ------------------------------------------------------------------ config errors
    Bug("override-late-binding", "jaxrl/config/load.py",
        "lambda item=item: OmegaConf.from_dotlist([item])",
        "lambda: OmegaConf.from_dotlist([item])",
        "Every dotted override applies the last override's text (a late-binding closure).",
        ("tests/config/test_load.py::test_yaml_then_overrides_later_wins",)),
    Bug("optim-total-equals-warmup", "jaxrl/config/algo.py",
        "not self.total_steps > self.warmup_steps",
        "not self.total_steps >= self.warmup_steps",
        "optim.total_steps equal to optim.warmup_steps (no decay steps) is accepted.",
        ("tests/config/test_algo.py::test_bad_values_raise_naming_the_field[total_steps-10-extra5]",)),
    # ------------------------------------------------------------------ sampling
    Bug("top-p-inclusive-mass", "jaxrl/rollout/sampling.py",
        "before_BxN = jnp.cumsum(probs_BxN, axis=-1) - probs_BxN",
        "before_BxN = jnp.cumsum(probs_BxN, axis=-1)",
        "Top-p keeps the tokens whose mass *including* themselves is below p: the prefix "
        "stops short of p.",
        ("tests/rollout/test_sampling.py::test_top_p_draws_only_from_the_smallest_prefix_reaching_p[0.5-0]",)),
    # ------------------------------------------------------------------ rewards
    Bug("reward-bound-exclusive", "jaxrl/rl/rewards.py",
        "failed_B = ~((r_B >= low) & (r_B <= high))",
        "failed_B = ~((r_B >= low) & (r_B < high))",
        "A JAX reward at its upper bound (e.g. 1.0 for a correct answer) counts as failed.",
        ("tests/rl/test_rewards.py::test_jax_values_outside_bounds_or_non_finite_become_zero_and_count",)),
    Bug("max-total-bounds-swapped", "jaxrl/rl/rewards.py",
        "r.weight * (r.bounds[1] if r.weight > 0 else r.bounds[0])",
        "r.weight * (r.bounds[0] if r.weight > 0 else r.bounds[1])",
        "The highest total takes each reward at its worst end, so `solved` is wrong.",
        ("tests/rl/test_rewards.py::test_max_total_takes_each_reward_at_the_best_end_of_its_bounds",)),
    Bug("overlong-sign", "jaxrl/rl/shaping.py",
        "linear_B = (soft_start - length_B) / cache_len",
        "linear_B = (length_B - soft_start) / cache_len",
        "DAPO's overlong penalty becomes a bonus inside the soft zone.",
        ("tests/rl/test_shaping.py::test_overlong_penalty_by_hand",)),
    # ------------------------------------------------------------------ optimizer
    Bug("cosine-ignores-warmup", "jaxrl/step/optimizer.py",
        "cfg.lr, cfg.total_steps - cfg.warmup_steps, alpha=cfg.min_lr_ratio)",
        "cfg.lr, cfg.total_steps, alpha=cfg.min_lr_ratio)",
        "The cosine decays over total_steps after the warmup, reaching its floor late.",
        ("tests/step/test_optimizer.py::test_schedule_worked_values[cfg4-60-0.00055]",)),
    Bug("decay-stacked-norms", "jaxrl/step/optimizer.py",
        '_STACKING_AXES = ("layers", "qkv", "gate_up")',
        '_STACKING_AXES = ("qkv", "gate_up")',
        "Weight decay reaches the scanned layers' stacked vectors (norm scales, q/k/v biases).",
        ("tests/step/test_optimizer.py::test_decay_mask_of_the_transformer[qwen2-True]",)),
)


# ------------------------------------------------------------------ the copies


def tracked_files(tree: Path) -> list[str]:
    """The tree's tracked files that exist on disk (deleted ones skipped)."""
    out = subprocess.run(["git", "-C", str(tree), "ls-files", "-z"], check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (tree / f).is_file()]


def copy_tree(tree: Path, files: list[str], into: Path) -> Path:
    """The tracked `files` of `tree` copied to `into`/tree (real copies, never links: a test
    that writes into the copy must not touch the original)."""
    root = into / "tree"
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / f, root / f)
    return root


def apply(root: Path, bug: Bug) -> None:
    path = root / bug.file
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(f"seeded bug {bug.id}: {bug.file} holds its original text {count} "
                         f"times, expected exactly once: {bug.old!r}")
    path.write_text(text.replace(bug.old, bug.new))


def line_of(tree: Path, bug: Bug) -> int:
    text = (tree / bug.file).read_text()
    index = text.find(bug.old)
    return text[:index].count("\n") + 1 if index >= 0 else 0


def child_env(root: Path) -> dict[str, str]:
    """The environment of a pytest run in copy `root`: the copy first on PYTHONPATH, and none
    of the variables by which a test run talks to an enclosing one (JAXRL_TESTS_RAN, CI's
    record of the tests that ran; JAXRL_TESTS_CRASH_DIR, JAXRL_TEST_TIMES; pytest's own)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAXRL_TEST", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def check_imports_the_copy(root: Path) -> None:
    """jaxrl, as a test in the copy imports it, is the copy's (not the editable install's)."""
    out = subprocess.run([sys.executable, "-c", "import jaxrl; print(jaxrl.__file__)"],
                         cwd=root, env=child_env(root), capture_output=True, text=True,
                         check=True).stdout.strip()
    if Path(out).resolve() != (root / "jaxrl" / "__init__.py").resolve():
        raise SystemExit(f"the copy at {root} imports jaxrl from {out}, not from the copy")


def pytest(root: Path, args: list[str], timeout: float = TIMEOUT_S
           ) -> tuple[int | None, str]:
    """(exit code, None on a timeout; output) of pytest in copy `root`."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
               *args]
    try:
        result = subprocess.run(command, cwd=root, env=child_env(root), capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return result.returncode, result.stdout + result.stderr


def verdict(code: int | None, out: str, nodes: tuple[str, ...]) -> tuple[bool, str]:
    """(caught, why) of a bug's pytest run: caught when one of its tests FAILED (exit 1, and
    pytest's summary names it); why: the test and the first line of its assertion, or what
    happened instead (an error in a fixture, a collection or import error, a timeout)."""
    if code is None:
        return False, f"pytest timed out after {TIMEOUT_S} s"
    summary = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    failed = [n for n in nodes if any(line == f"FAILED {n}" or line.startswith(f"FAILED {n} ")
                                      for line in summary)]
    if code != 1 or not failed:
        return False, f"pytest exit {code}, not a failed test: {' | '.join(summary)[:200]}"
    # The first line of the assertion that says something (numpy's start with a bare
    # "AssertionError:", their next line is the comparison).
    lines = [line[1:].strip() for line in out.splitlines() if line.startswith("E ")]
    first = next((line for line in lines if line and line != "AssertionError:"), "")
    name = failed[0].split("::", 1)[1]
    return True, f"{name}: {first}"[:160]


def check_fast_tier(root: Path, nodes: list[str]) -> None:
    """Every node id exists and is collected by the fast tier (pyproject's default -m)."""
    avoided = [n for n in nodes if n.startswith(AVOID)]
    if avoided:
        raise SystemExit(f"seeded bugs must not depend on {AVOID}: {avoided}")
    code, out = pytest(root, ["--collect-only", "-q", *nodes], timeout=600)
    collected = {line.strip() for line in out.splitlines()}
    missing = [n for n in nodes if n not in collected]
    if code != 0 or missing:
        raise SystemExit(f"not collected by the fast tier (exit {code}): {missing}\n"
                         f"{out[-3000:]}")


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these bugs")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the git tree to copy (default: this script's repository)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary copies (their folder is printed)")
    args = parser.parse_args(argv)
    tree = args.tree.resolve()

    ids = [b.id for b in BUGS]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise SystemExit(f"duplicate bug ids: {duplicates}")
    bugs = BUGS
    if args.only:
        unknown = sorted(set(args.only) - set(ids))
        if unknown:
            raise SystemExit(f"unknown bug ids {unknown}; known: {', '.join(ids)}")
        bugs = tuple(b for b in BUGS if b.id in args.only)

    if args.list:
        for b in bugs:
            print(f"{b.id}  {b.file}:{line_of(tree, b)}  {b.breaks}")
            print(f"    - {b.old.strip()}\n    + {b.new.strip()}")
            for node in b.tests:
                print(f"    caught by {node}")
        return 0

    start = time.monotonic()
    files = tracked_files(tree)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-seeded-bugs-"))
    print(f"{len(bugs)} seeded bugs; {len(files)} tracked files of {tree} copied per bug "
          f"into {work}", flush=True)
    try:
        # Every bug's original text is there exactly once before anything runs.
        for b in bugs:
            apply(copy_tree(tree, [b.file], work / "check" / b.id), b)
        nodes = list(dict.fromkeys(n for b in bugs for n in b.tests))
        base = copy_tree(tree, files, work / "baseline")
        check_imports_the_copy(base)
        check_fast_tier(base, nodes)
        t0 = time.monotonic()
        code, out = pytest(base, ["-q", *nodes])
        print(f"{'baseline':28s} {'passed' if code == 0 else 'FAILED':11s} "
              f"{time.monotonic() - t0:5.1f} s  {len(nodes)} tests on the unchanged tree",
              flush=True)
        if code != 0:
            print(out[-6000:])
            print("the baseline fails: the seeded bugs prove nothing until it passes")
            return 1
        shutil.rmtree(base)

        missed = []
        for b in bugs:
            t0 = time.monotonic()
            root = copy_tree(tree, files, work / b.id)
            check_imports_the_copy(root)
            apply(root, b)
            code, out = pytest(root, ["-q", "-x", *b.tests])
            seconds = time.monotonic() - t0
            caught, why = verdict(code, out, b.tests)
            if not caught:
                missed.append(b.id)
            print(f"{b.id:28s} {'caught' if caught else 'NOT CAUGHT':11s} {seconds:5.1f} s  "
                  f"{why}", flush=True)
            if not caught:
                print("    " + "\n    ".join(out[-3000:].splitlines()))
            if not args.keep:
                shutil.rmtree(work / b.id)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    minutes = (time.monotonic() - start) / 60
    if missed:
        print(f"{len(missed)} of {len(bugs)} seeded bugs NOT CAUGHT: {', '.join(missed)} "
              f"({minutes:.1f} min)")
        return 1
    print(f"all {len(bugs)} seeded bugs caught ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
