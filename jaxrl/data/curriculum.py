"""Prompt curricula: which dataset positions the next RL step trains on.

A *prompt sampler* decides the positions (0..N-1 over the N usable prompts) of each step's
batch of B prompts; `PromptBatches` gathers the arrays. Chosen by `data.curriculum`:

- `none` -- uniform epochs. Epoch e visits the prompts in the permutation drawn from
  `np.random.default_rng((seed, e))`; the last N mod B prompts of each epoch's order are
  dropped, never wrapped into the next epoch, so a batch never holds a prompt twice.
- `ordered` -- easy to hard. Epoch e visits the prompts in ascending `difficulty_N`, ties in
  the order of epoch e's permutation (the same one as `none`), remainder dropped. Deviation to
  know: with distinct difficulties the dropped remainder is always the N mod B hardest.
- `pass_rate` -- learning-signal sampling. Each prompt i has a pass rate p_i, the exponential
  moving average of the success values s in [0, 1] observed for it (the fraction of its group
  that solved it; the first observation sets p_i = s, later ones p_i <- (1 - a) p_i + a s with
  a = `ema_weight`), and a learning signal v_i, the same average of the observed signal values
  d in [0, 1]: whether the group's rewards differed (a group whose G rewards are all equal has
  zero group-relative advantage). The weight of prompt i is

      w_i = 1                              if i was never observed
      w_i = floor + (1 - floor) * v_i      otherwise

  with floor = 0.3, so solved and unsolvable prompts are still revisited now and then. A low
  floor (such as 0.05) concentrates the steps on a few prompts, which training then drives
  to zero variance itself: on the quickstart it raised the zero-variance fraction above
  uniform sampling's, while 0.3 lowers it by about 40% (benchmarks/README.md, "Curriculum"). The
  prompts of the LAG - 1 draws whose results are still pending get the floor too: they were
  just trained on, so their signal is unknown, and drawing them again at once would train on
  the same prompts step after step. When
  no signal is observed, d is its expectation for binary rewards: a group of G Bernoulli(s)
  samples disagrees with probability d = 1 - s^G - (1-s)^G (G = `rollout.num_generations`).
  The training loop passes the observed d: with partial-credit rewards (the quickstart's) a
  never-solved prompt can still give a signal, and a half-solved one none. Step n takes B *distinct* prompts by successive sampling
  without replacement, each pick with probability w_i / (sum of the remaining weights),
  implemented as Efraimidis-Spirakis keys log(u_i) / w_i (u_i uniform in (0, 1]) of which the
  B largest win, with u drawn from `np.random.default_rng((seed, n))`.

Observations and determinism: the loop calls `observe(step, positions_B, success_B, signal_B)`
with the per-prompt success and signal of the batch it drew for `step` (global positions, the order of the draw).
Results arrive late and at varying times, so an observation only takes effect when the batch
of step `step + LAG` is drawn: the batch of step n sees exactly the observations of steps
0..n-LAG, whenever they arrived, and it is an error to draw it before step n-LAG is observed.
(LAG is the `lag` of the sampler: LAG + max_staleness in algo.mode=async, whose batches are
drawn that many steps before their turn.)
`none` and `ordered` accept observations and ignore them.

`state()` is a flat dict of str -> numpy arrays (0-d for scalars: an orbax pytree restored
without a target) holding everything the next draws depend on, pending observations included:
`curriculum` (index in CURRICULA), `num_prompts`, `batch_size`, `seed`, then `epoch`, `offset`
(epoch samplers) or `step`, `pass_rate_N`, `signal_N`, `seen_N` and the last LAG draws with
their observations so far, `recent_positions_LxB`, `recent_observed_L`, `recent_success_LxB`,
`recent_signal_LxB` (`pass_rate`). `restore` of it resumes exactly and names any key, shape or value that does
not fit.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Mapping

import numpy as np

from jaxrl.data.pass_rate import PassRateConfig, binomial_signal, signal_weight
from jaxrl.data.section import Curriculum

CURRICULA: tuple[Curriculum, ...] = typing.get_args(Curriculum)
LAG = 2  # the batch of step n sees the observations of steps 0..n-LAG

_INT, _FLOAT, _BOOL = "integer", "floating", "bool"
_KINDS = {_INT: np.integer, _FLOAT: np.floating, _BOOL: np.bool_}


class PromptSampler(abc.ABC):
    """Draws the positions of each step's batch; observes results; saves and restores itself."""

    kind: Curriculum

    def __init__(self, num_prompts: int, batch_size: int, seed: int):
        if not 1 <= batch_size <= num_prompts:
            raise ValueError(f"batch_size={batch_size} must be between 1 and the "
                             f"{num_prompts} usable prompts")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.num_prompts, self.batch_size, self.seed = num_prompts, batch_size, seed

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Batches drawn so far: the step whose batch `draw` returns next."""

    @abc.abstractmethod
    def draw(self) -> np.ndarray:
        """The next step's positions_B (int64, distinct, in 0..num_prompts-1)."""

    @abc.abstractmethod
    def observe(self, step: int, positions_B: np.ndarray, success_B: np.ndarray,
                signal_B: np.ndarray | None = None) -> None:
        """Queue the per-prompt success (and learning signal) of the batch drawn for `step`
        (module docstring)."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics log."""

    @abc.abstractmethod
    def _spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The sampler's own state keys -> (shape, dtype kind)."""

    @abc.abstractmethod
    def _own_state(self) -> dict[str, np.ndarray]:
        """The sampler's own state arrays, keyed as in `_spec`."""

    @abc.abstractmethod
    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        """Adopt checked arrays of `_spec`; raise ValueError naming an out-of-range value."""

    def _identity(self) -> dict[str, int]:
        return {"curriculum": CURRICULA.index(self.kind), "num_prompts": self.num_prompts,
                "batch_size": self.batch_size, "seed": self.seed}

    def state(self) -> dict[str, np.ndarray]:
        """Everything the following draws depend on, as a flat dict of numpy arrays."""
        ids = {k: np.asarray(v, np.int64) for k, v in self._identity().items()}
        return ids | self._own_state()

    def restore(self, state: Mapping[str, typing.Any]) -> None:
        """Resume from `state()`: the following draws equal the uninterrupted ones."""
        identity = self._identity()
        arrays = {}
        for key, (shape, kind) in ({k: ((), _INT) for k in identity} | self._spec()).items():
            if key not in state:
                raise ValueError(f"{self.kind!r} prompt sampler state is missing key {key!r}; "
                                 f"it has {sorted(state)}")
            arrays[key] = array = np.asarray(state[key])
            if array.shape != shape or not np.issubdtype(array.dtype, _KINDS[kind]):
                raise ValueError(f"{self.kind!r} prompt sampler state {key!r} must be a {kind} "
                                 f"array of shape {shape}, got {array.dtype} {array.shape}")
            if key in identity and int(array) != identity[key]:
                raise ValueError(f"prompt sampler state has {key}={_show(key, int(array))} but "
                                 f"this iterator has {key}={_show(key, identity[key])}")
        unexpected = sorted(set(state) - set(arrays))
        if unexpected:
            raise ValueError(f"{self.kind!r} prompt sampler state has unexpected keys "
                             f"{unexpected}")
        self._set_state({k: arrays[k] for k in self._spec()})


def _show(key: str, value: int) -> str:
    if key == "curriculum" and 0 <= value < len(CURRICULA):
        return repr(CURRICULA[value])
    return str(value)


class EpochSampler(PromptSampler):
    """`none` (uniform epochs) or, given difficulty_N, `ordered` (easy -> hard epochs)."""

    def __init__(self, num_prompts: int, batch_size: int, seed: int, *,
                 difficulty_N: np.ndarray | None = None):
        super().__init__(num_prompts, batch_size, seed)
        self.kind = "none" if difficulty_N is None else "ordered"
        self.difficulty_N = None if difficulty_N is None else _checked_difficulty(
            difficulty_N, num_prompts)
        self.batches_per_epoch = num_prompts // batch_size
        self._epoch, self._offset = 0, 0
        self._order_epoch, self._order_N = -1, np.empty(0, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s visiting order of the positions (the remainder at its end)."""
        if epoch != self._order_epoch:
            order_N = np.random.default_rng((self.seed, epoch)).permutation(self.num_prompts)
            if self.difficulty_N is not None:  # a stable sort keeps ties in permutation order
                order_N = order_N[np.argsort(self.difficulty_N[order_N], kind="stable")]
            self._order_epoch, self._order_N = epoch, order_N
        return self._order_N

    @property
    def step(self) -> int:
        return self._epoch * self.batches_per_epoch + self._offset // self.batch_size

    def draw(self) -> np.ndarray:
        positions_B = self.order(self._epoch)[self._offset:self._offset + self.batch_size].copy()
        self._offset += self.batch_size
        if self._offset + self.batch_size > self.num_prompts:  # the rest is the remainder
            self._epoch, self._offset = self._epoch + 1, 0
        return positions_B

    def observe(self, step: int, positions_B: np.ndarray, success_B: np.ndarray,
                signal_B: np.ndarray | None = None) -> None:
        del step, positions_B, success_B, signal_B  # the order does not depend on results

    def metrics(self) -> dict[str, float]:
        return {"data/epoch": self._epoch + self._offset / (self.batches_per_epoch
                                                             * self.batch_size)}

    def _spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"epoch": ((), _INT), "offset": ((), _INT)}

    def _own_state(self) -> dict[str, np.ndarray]:
        return {"epoch": np.asarray(self._epoch, np.int64),
                "offset": np.asarray(self._offset, np.int64)}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        epoch, offset = int(state["epoch"]), int(state["offset"])
        last = (self.batches_per_epoch - 1) * self.batch_size
        if epoch < 0 or not 0 <= offset <= last or offset % self.batch_size:
            raise ValueError(f"prompt sampler state epoch={epoch}, offset={offset} is out of "
                             f"range: offset must be a multiple of batch_size="
                             f"{self.batch_size} from 0 to {last}, epoch non-negative")
        self._epoch, self._offset = epoch, offset


class PassRateSampler(PromptSampler):
    """`pass_rate`: distinct prompts drawn with weight for the learning signal they still give."""

    kind = "pass_rate"

    def __init__(self, num_prompts: int, batch_size: int, seed: int,
                 config: PassRateConfig | None = None, lag: int = LAG):
        super().__init__(num_prompts, batch_size, seed)
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an integer >= 1, got {lag!r}")
        self.lag = lag
        self.config = config or PassRateConfig()
        self._step = 0
        self._pass_N = np.zeros(num_prompts)
        self._signal_N = np.zeros(num_prompts)
        self._seen_N = np.zeros(num_prompts, bool)
        # Slot k holds the draw of step `_step - self.lag + k` and, once observed, its success.
        self._recent_LxB = np.full((self.lag, batch_size), -1, np.int64)
        self._observed_L = np.zeros(self.lag, bool)
        self._success_LxB = np.zeros((self.lag, batch_size))
        self._signal_LxB = np.zeros((self.lag, batch_size))

    @property
    def step(self) -> int:
        return self._step

    def weights(self) -> np.ndarray:
        """weight_N from the observations applied so far (steps 0..step-1-lag)."""
        return signal_weight(self._signal_N, self._seen_N, self.config)

    def draw(self) -> np.ndarray:
        due = self._step - self.lag
        if due >= 0:
            if not self._observed_L[0]:
                raise ValueError(f"the batch of step {self._step} needs the observation of "
                                 f"step {due} (pass_rate curriculum, lag={self.lag}): call "
                                 f"observe({due}, positions_B, success_B) first")
            self._apply(self._recent_LxB[0], self._success_LxB[0], self._signal_LxB[0])
        weight_N = self.weights()
        # The prompts of the draws whose results are still pending were just trained on: what
        # they would give now is unknown, so they wait (at the floor) rather than repeat.
        pending = self._recent_LxB[1:][self._recent_LxB[1:] >= 0]
        weight_N[pending] = self.config.floor
        rng = np.random.default_rng((self.seed, self._step))
        keys_N = np.log1p(-rng.random(self.num_prompts)) / weight_N  # log(u), u in (0, 1]
        top_B = np.argpartition(-keys_N, self.batch_size - 1)[:self.batch_size]
        positions_B = top_B[np.argsort(-keys_N[top_B], kind="stable")].astype(np.int64)
        self._recent_LxB = np.concatenate([self._recent_LxB[1:], positions_B[None]])
        self._observed_L = np.append(self._observed_L[1:], False)
        self._success_LxB = np.concatenate([self._success_LxB[1:],
                                            np.zeros((1, self.batch_size))])
        self._signal_LxB = np.concatenate([self._signal_LxB[1:], np.zeros((1, self.batch_size))])
        self._step += 1
        return positions_B

    def _apply(self, positions_B: np.ndarray, success_B: np.ndarray,
               signal_B: np.ndarray) -> None:
        a, seen_B = self.config.ema_weight, self._seen_N[positions_B]
        for average_N, value_B in ((self._pass_N, success_B), (self._signal_N, signal_B)):
            average_N[positions_B] = np.where(seen_B, (1 - a) * average_N[positions_B]
                                              + a * value_B, value_B)
        self._seen_N[positions_B] = True

    def observe(self, step: int, positions_B: np.ndarray, success_B: np.ndarray,
                signal_B: np.ndarray | None = None) -> None:
        if not 0 <= step < self._step:
            raise ValueError(f"observe(step={step}): only steps 0..{self._step - 1} have "
                             f"been drawn")
        slot = step - (self._step - self.lag)
        if slot < 0:
            raise ValueError(f"observe(step={step}) comes too late: the batch of step "
                             f"{step + self.lag} has already been drawn without it")
        if self._observed_L[slot]:
            raise ValueError(f"step {step} was already observed")
        positions_B, success_B = np.asarray(positions_B), np.asarray(success_B, np.float64)
        if not np.array_equal(positions_B, self._recent_LxB[slot]):
            raise ValueError(f"observe(step={step}) got positions {positions_B.tolist()}, "
                             f"but step {step} drew {self._recent_LxB[slot].tolist()} (pass "
                             f"the global batch's positions, in the order drawn)")
        if success_B.shape != (self.batch_size,) or not np.all((success_B >= 0)
                                                              & (success_B <= 1)):
            raise ValueError(f"observe(step={step}) needs success_B of shape "
                             f"({self.batch_size},) with values in [0, 1], got "
                             f"{success_B.shape} {success_B.tolist()}")
        if signal_B is None:
            signal_B = binomial_signal(success_B, self.config.group_size)
        signal_B = np.asarray(signal_B, np.float64)
        if signal_B.shape != (self.batch_size,) or not np.all((signal_B >= 0)
                                                            & (signal_B <= 1)):
            raise ValueError(f"observe(step={step}) needs signal_B of shape "
                             f"({self.batch_size},) with values in [0, 1], got "
                             f"{signal_B.shape} {signal_B.tolist()}")
        self._observed_L[slot] = True
        self._success_LxB[slot] = success_B
        self._signal_LxB[slot] = signal_B

    def metrics(self) -> dict[str, float]:
        """data/epoch (prompts drawn / N), curriculum/seen_frac and, once any prompt has been
        observed, curriculum/mean_pass_rate over the observed prompts."""
        out = {"data/epoch": self._step * self.batch_size / self.num_prompts,
               "curriculum/seen_frac": float(self._seen_N.mean())}
        if self._seen_N.any():
            out["curriculum/mean_pass_rate"] = float(self._pass_N[self._seen_N].mean())
        return out

    def _spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        n, b, lag = self.num_prompts, self.batch_size, self.lag
        return {"step": ((), _INT), "pass_rate_N": ((n,), _FLOAT), "signal_N": ((n,), _FLOAT),
                "seen_N": ((n,), _BOOL), "recent_positions_LxB": ((lag, b), _INT),
                "recent_observed_L": ((lag,), _BOOL), "recent_success_LxB": ((lag, b), _FLOAT),
                "recent_signal_LxB": ((lag, b), _FLOAT)}

    def _own_state(self) -> dict[str, np.ndarray]:
        return {"step": np.asarray(self._step, np.int64), "pass_rate_N": self._pass_N.copy(),
                "seen_N": self._seen_N.copy(), "recent_positions_LxB": self._recent_LxB.copy(),
                "recent_observed_L": self._observed_L.copy(),
                "recent_success_LxB": self._success_LxB.copy(),
                "signal_N": self._signal_N.copy(), "recent_signal_LxB": self._signal_LxB.copy()}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        step, recent_LxB = int(state["step"]), state["recent_positions_LxB"]
        drawn_L = np.arange(step - self.lag, step) >= 0
        if step < 0:
            raise ValueError(f"prompt sampler state step={step} is negative")
        if not (np.all((recent_LxB[drawn_L] >= 0) & (recent_LxB[drawn_L] < self.num_prompts))
                and np.all(recent_LxB[~drawn_L] == -1)):
            raise ValueError(f"prompt sampler state recent_positions_LxB="
                             f"{recent_LxB.tolist()} does not fit step={step} and "
                             f"{self.num_prompts} prompts")
        for key in ("pass_rate_N", "recent_success_LxB", "signal_N", "recent_signal_LxB"):
            if not np.all((state[key] >= 0) & (state[key] <= 1)):
                raise ValueError(f"prompt sampler state {key} has values outside [0, 1]")
        self._step, self._recent_LxB = step, recent_LxB.astype(np.int64)
        self._pass_N = state["pass_rate_N"].astype(np.float64)
        self._seen_N = state["seen_N"].copy()
        self._observed_L = state["recent_observed_L"].copy()
        self._success_LxB = state["recent_success_LxB"].astype(np.float64)
        self._signal_N = state["signal_N"].astype(np.float64)
        self._signal_LxB = state["recent_signal_LxB"].astype(np.float64)


def _checked_difficulty(difficulty_N: np.ndarray, num_prompts: int) -> np.ndarray:
    try:
        difficulty_N = np.asarray(difficulty_N, np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"difficulty_N must hold numbers: {e}") from None
    if difficulty_N.shape != (num_prompts,):
        raise ValueError(f"difficulty_N must have one value per usable prompt, shape "
                         f"({num_prompts},), got {difficulty_N.shape}")
    bad = np.flatnonzero(~np.isfinite(difficulty_N))
    if len(bad):
        raise ValueError(f"difficulty_N has {len(bad)} non-finite values (NaN or inf), the "
                         f"first at position {bad[0]}: {difficulty_N[bad[0]]}")
    return difficulty_N


def make_prompt_sampler(kind: Curriculum, num_prompts: int, batch_size: int, seed: int, *,
                        difficulty_N: np.ndarray | None = None,
                        group_size: int = 1, lag: int = LAG) -> PromptSampler:
    """The sampler of curriculum `kind` (difficulty_N only for `ordered`, group_size is G;
    `lag`: the steps between a step and the first draw that sees its results, for
    `pass_rate`: LAG, or LAG + max_staleness when batches are drawn that far ahead)."""
    if kind not in CURRICULA:
        raise ValueError(f"unknown curriculum {kind!r}; expected one of {list(CURRICULA)}")
    if (kind == "ordered") != (difficulty_N is not None):
        raise ValueError("the 'ordered' curriculum needs difficulty_N (one number per usable "
                         "prompt)" if kind == "ordered" else
                         f"difficulty_N is only used by the 'ordered' curriculum, not {kind!r}")
    if kind == "pass_rate":
        return PassRateSampler(num_prompts, batch_size, seed, PassRateConfig(group_size), lag)
    return EpochSampler(num_prompts, batch_size, seed, difficulty_N=difficulty_N)
