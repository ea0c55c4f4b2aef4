"""Speculation policy: how many draft steps each padded batch size runs (0 = target-only).

Host-side arithmetic only (no tensors on the device, no sync): the Engine feeds it what it
already reads back (accept lengths, one step late in the zero-sync cycle) and the capture-time
timings of each captured configuration, and asks `decide(padded_bs) -> k` once per cycle.

Model. A decode row verified with k drafts commits a in 1..k+1 tokens. With a per-draft match
rate alpha (draft j is accepted given drafts 1..j-1 were), the matched drafts m = a - 1 are a
truncated geometric observation: P(m = j) = alpha^j (1 - alpha) for j < k, P(m = k) = alpha^k.
Each row is a run of Bernoulli trials that stops at the first failure or after k trials:
successes = m, trials = m + (m < k). The maximum-likelihood alpha is successes / trials.

  expected tokens per verify at k drafts  E(k) = (1 - alpha^(k+1)) / (1 - alpha)   (alpha = 1: k + 1)
  tokens per ms at padded bs and k        E(k) / cost_ms[(bs, k)]                  (per row; bs cancels)

`AcceptRateEstimator` keeps exponentially decayed success / trial counts per batch (and, when
given request slots, per slot), started from a prior (`prior_alpha`, `prior_weight` pseudo-trials)
so that a cold start speculates; each `observe` (one verify step) multiplies the counts by
`decay` before adding the step's, and so does each k = 0 decision of the policy (`age()`: the
EMA runs over cycles, so evidence gathered before a stretch of target-only cycles fades and a
probe weighs in). `upper_bound()` is the Wilson score upper bound of alpha over
the effective trial count.

`CostTable` holds `cost_ms[(padded_bs, k)]` (k = 0: the target-only decode step) measured on the
device at capture (`measure_replay_ms` times a replay with CUDA events), interpolating linearly in
bs for a k that has entries, and linearly in k otherwise; corrected online: the Engine records a
pair of CUDA timing events around every decode cycle it launches and reads them when it retires
that cycle (one step later, completed by then: `CycleTimer`, no sync), and `observe_cost` keeps
the median of the last `window` real cycles per (padded bs, k), which replaces the capture-time
figure once measured (a median: one slow cycle, e.g. the first after an idle GPU, moves nothing;
an EMA let one such cycle price a k out for good, since an unchosen k is never timed again).
The capture-time replays run inert rows, so they price real cycles low (perf/RESULTS.md).

`SpeculationPolicy`:
  "fixed"     always `num_steps` drafts;
  "adaptive"  the k in `steps` (the captured set, 0 included) maximising the score
              E(k) / (cost(bs, k) + extra_ms) at the point estimate of alpha (the measured
              accepts: the prior is a few pseudo-trials, outweighed after a few cycles), over
              the eligible k:
              - safety: k > 0 only when its score at alpha's upper bound beats k = 0;
              - margin: k > 0 only when its score beats k = 0's by `spec_margin`: where
                speculation breaks even, k = 0 (deterministic cost) beats a bet whose
                realized accept and cost estimate both carry noise;
              - hysteresis: a current k > 0 of that bs stays (while eligible) unless another
                k > 0 scores more than `hysteresis` above it, so k = 1 and k = S near
                their crossover do not flap (between k = 0 and k > 0 the margin alone: k = 0
                is sticky anyway, the estimate moves only when a probe observes);
              - probing: at k = 0 the estimate gets no data; after `probe_interval(bs)`
                decisions with no observation of a k > 0 step, `probe_cycles` consecutive
                decisions return the smallest k1 > 0 of `steps` (counted as one probe), so a
                regime change is noticed. Two, because a k = 0 cycle drafts nothing: the
                first probe cycle verifies filler (no observation) and drafts; the second
                verifies those drafts. The schedule: I = max(`probe_every`,
                ceil(loss / `probe_budget`)) decisions between probes, where loss, in k = 0
                cycles, is (r - 1) + (probe_cycles - 1) * max(r - E(alpha_lo, k1), 0) at the
                cost ratio r = cost(bs, k1) / cost(bs, 0) and alpha's Wilson lower bound
                alpha_lo. Bounded cost: probes take at most loss / I <= `probe_budget` of the
                target-only time whenever the true rate is >= alpha_lo; a useless head (true
                rate 0) drives alpha_lo to 0 within a k = 0 stretch (aging shrinks the trial
                count), where loss is its worst case probe_cycles * (r - 1): so with the
                defaults (2 cycles, budget 0.003) a probe comes every
                max(16, ceil(667 * (r - 1))) decisions (e.g. r = 1.1: every 67; r = 2: every
                667) and costs at most 0.3 % of the time, whatever the drafts do. A probe
                that sees accepts raises alpha (one observed probe cycle of `bs` rows adds
                `bs` trials to a trial count the stretch aged down), and the eligibility
                rules above then pick k > 0 again at once if it beats k = 0.
              Settling on k = 0 at zero acceptance: each observed verify of k >= 1 drafts adds
                one trial and no success per row, so after c observed cycles of at least one
                row the point estimate is at most prior_alpha * prior_weight / (prior_weight +
                c) (1.4 / (2 + c) with the defaults); a k > 0 stays eligible only while
                E(alpha, k) >= (1 + spec_margin) * cost(bs, k) / cost(bs, 0), i.e. alpha >=
                about 1 - 1 / ((1 + spec_margin) * r_k): with r_k >= 1.05, alpha >= 0.066, so
                k = 0 from the 20th observed cycle on at bs 1 (sooner with more rows a
                cycle: at bs 8, the 3rd). `tests/test_useless_draft_policy.py` checks both.
              - cost probes: while a k > 0 is chosen, another eligible k > 0 whose score lies
                within `cost_probe_margin` of it runs `cost_probe_cycles` consecutive
                cycles when its cost at that bs is still extrapolated, and again (a refresh, its
                old samples dropped) once it has not run for `refresh_interval` decisions: the
                interval spends at most `cost_refresh_budget` of the time on refreshes
                at the score gap, at least `cost_refresh` decisions. So two close k are
                compared on measured, current costs: a cost measured during a slow spell (a few
                consecutive slow cycles, perf/RESULTS.md) or at shorter contexts
                cannot keep a close k out for good.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["POLICY_MODES", "AcceptRateEstimator", "CostTable", "CycleTimer", "SpeculationPolicy",
           "analytic_cost_table", "check_speculative_policy", "expected_tokens", "load_costs",
           "measure_replay_ms", "save_costs"]

POLICY_MODES = ("adaptive", "fixed")


def check_speculative_policy(value: Any) -> str:
    """The `--speculative-policy` value check (CLI and config): returns it, or raises ValueError."""
    if not isinstance(value, str) or value not in POLICY_MODES:
        raise ValueError(f"--speculative-policy: expected one of {list(POLICY_MODES)}, got {value!r}")
    return value


def _check_prob(name: str, x: Any, *, open_low: bool = False, open_high: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number in [0, 1], got {x!r}")
    x = float(x)
    if x < 0 or x > 1 or (open_low and x == 0) or (open_high and x == 1):
        lo, hi = "(" if open_low else "[", ")" if open_high else "]"
        raise ValueError(f"{name}: expected a number in {lo}0, 1{hi}, got {x!r}")
    return x


def _check_int(name: str, x: Any, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x!r}")
    return int(x)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens committed per verify with k drafts at match rate alpha:
    (1 - alpha^(k+1)) / (1 - alpha), and k + 1 at alpha = 1."""
    alpha = _check_prob("alpha", alpha)
    k = _check_int("k", k, 0)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _wilson(successes: float, trials: float, z: float, side: int) -> float:
    """Wilson score bound of a rate: upper (side +1; 1 without trials) or lower (side -1; 0
    without trials)."""
    if trials <= 0:
        return 1.0 if side > 0 else 0.0
    p = min(max(successes / trials, 0.0), 1.0)
    z2 = z * z
    centre = p + z2 / (2 * trials)
    half = z * math.sqrt(max(p * (1 - p) / trials + z2 / (4 * trials * trials), 0.0))
    return min(1.0, max(0.0, (centre + side * half) / (1 + z2 / trials)))


def _as_int_array(name: str, x: Any) -> np.ndarray:
    """A 1-D int array from a list / tuple / numpy array / CPU torch tensor."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor: the caller's host copy
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a host (CPU) tensor (read back once per cycle), "
                             f"got one on {x.device}")
        x = x.detach().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {a.shape} "
                         f"dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


class AcceptRateEstimator:
    """Running estimate of the per-draft match rate alpha (module docstring).

    `prior_alpha` in (0, 1], `prior_weight` > 0 pseudo-trials (2: a cold start speculates,
    and at bs 1, one row a cycle, the prior is outweighed after a few cycles; 8 kept a p = 0.2
    regime at alpha ~ 0.45 after perf/policy.py's warm-up), `decay` in (0, 1] per observed
    step (1: plain running totals), `z` the Wilson bound's normal quantile, `max_slots`: keep
    per-request-slot estimates for slots 0..max_slots-1 (None: batch only).
    """

    def __init__(self, prior_alpha: float = 0.7, prior_weight: float = 2.0, decay: float = 0.99,
                 z: float = 1.64, max_slots: int | None = None) -> None:
        self.prior_alpha = _check_prob("prior_alpha", prior_alpha, open_low=True)
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) \
                or not math.isfinite(prior_weight) or prior_weight <= 0:
            raise ValueError(f"prior_weight: expected a finite number > 0, got {prior_weight!r}")
        self.prior_weight = float(prior_weight)
        self.decay = _check_prob("decay", decay, open_low=True)
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
            raise ValueError(f"z: expected a finite number >= 0, got {z!r}")
        self.z = float(z)
        self.max_slots = None if max_slots is None else _check_int("max_slots", max_slots, 1)
        self.reset()

    def reset(self) -> None:
        self.successes = self.prior_alpha * self.prior_weight
        self.trials = self.prior_weight
        self.observed_steps = 0
        self.observed_rows = 0
        if self.max_slots is not None:
            self.slot_successes = np.full(self.max_slots, self.prior_alpha * self.prior_weight)
            self.slot_trials = np.full(self.max_slots, self.prior_weight)

    def reset_slot(self, slot: int) -> None:
        """Back to the prior for a slot (call when a request takes or leaves it)."""
        if self.max_slots is None:
            raise ValueError("slot: this estimator keeps no per-slot estimates (max_slots=None)")
        slot = _check_int("slot", slot, 0)
        if slot >= self.max_slots:
            raise ValueError(f"slot: expected < max_slots ({self.max_slots}), got {slot}")
        self.slot_successes[slot] = self.prior_alpha * self.prior_weight
        self.slot_trials[slot] = self.prior_weight

    @staticmethod
    def counts(accept_lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row (successes, trials) of a verify with k drafts: (a - 1, a - 1 + (a <= k))."""
        m = accept_lengths - 1
        return m, m + (m < k)

    def observe(self, accept_lengths: Any, k: int, slots: Any = None) -> None:
        """One verify step: `accept_lengths [rows]` (each in 1..k+1: the real decode rows that
        verified k drafts, before any stop cut), `slots [rows]` their request slots (needs
        `max_slots`). k = 0 carries no information and changes nothing. Bad input raises
        ValueError and changes nothing."""
        k = _check_int("k", k, 0)
        a = _as_int_array("accept_lengths", accept_lengths)
        if a.size and (a.min() < 1 or a.max() > k + 1):
            raise ValueError(f"accept_lengths: expected values in 1..{k + 1} (k = {k} drafts), "
                             f"got min {a.min()} max {a.max()}")
        s = None
        if slots is not None:
            if self.max_slots is None:
                raise ValueError("slots: this estimator keeps no per-slot estimates (max_slots=None)")
            s = _as_int_array("slots", slots)
            if s.shape != a.shape:
                raise ValueError(f"slots: expected one slot per accept length ({a.size}), got {s.size}")
            if s.size and (s.min() < 0 or s.max() >= self.max_slots):
                raise ValueError(f"slots: expected values in 0..{self.max_slots - 1}")
            if np.unique(s).size != s.size:
                raise ValueError("slots: expected distinct slots (one row per request)")
        if k == 0 or a.size == 0:
            return
        succ, trials = self.counts(a, k)
        self.successes = self.decay * self.successes + float(succ.sum())
        self.trials = self.decay * self.trials + float(trials.sum())
        self.observed_steps += 1
        self.observed_rows += int(a.size)
        if s is not None:
            self.slot_successes[s] = self.decay * self.slot_successes[s] + succ
            self.slot_trials[s] = self.decay * self.slot_trials[s] + trials

    def age(self) -> None:
        """One step without information (a k = 0 cycle): the counts decay, the estimate stays,
        its upper bound widens, and the next observation weighs more."""
        self.successes *= self.decay
        self.trials *= self.decay

    @property
    def alpha(self) -> float:
        return self.successes / self.trials

    def upper_bound(self) -> float:
        """Wilson upper bound of alpha over the effective (decayed) trial count."""
        return _wilson(self.successes, self.trials, self.z, +1)

    def lower_bound(self) -> float:
        """Wilson lower bound of alpha over the effective (decayed) trial count (0 without
        trials: a long stretch of k = 0 cycles ages it towards 0)."""
        return _wilson(self.successes, self.trials, self.z, -1)

    def slot_alpha(self, slots: Any = None) -> np.ndarray:
        """Per-slot alpha estimates (all slots, or those given)."""
        if self.max_slots is None:
            raise ValueError("slots: this estimator keeps no per-slot estimates (max_slots=None)")
        est = self.slot_successes / self.slot_trials
        return est if slots is None else est[_as_int_array("slots", slots)]


class CostTable:
    """`cost_ms[(padded_bs, k)]`: device time of one cycle at padded bs with k drafts (k = 0:
    the target-only decode step), from capture-time timings. Missing entries interpolate:
    linearly in bs over the entries of the same k (beyond the ends: the nearest two, at least
    the nearest measured value's 1/1000); a k with no entry at all interpolates linearly in k
    between the nearest k below and above with entries (beyond them: ValueError).

    Online correction (`observe`): the device time of real cycles (the Engine's CUDA events
    around each launched cycle, read when the cycle is retired), per (padded_bs, k) the median
    of the last `window` observations (the first observation replaces the capture-time figure
    outright; one outlier in a window of 3 or more moves nothing); `cost` returns that median
    where there is one, else the capture-time figure scaled by the online / capture-time ratio
    of the nearest k' > 0 observed at that bs (for a k > 0 with none: k = 0's ratio; k = 0
    itself is left unscaled), so that one real k = 1 cycle also reprices k = S. The
    capture-time replays run inert rows; a real cycle also pays what they leave out
    (context-dependent attention, the verify's extend kernel at small bs, copies), and more so
    the more tokens it verifies and drafts."""

    def __init__(self, costs: Mapping[tuple[int, int], float] | None = None, *,
                 window: int = 5) -> None:
        self._by_k: dict[int, dict[int, float]] = defaultdict(dict)
        self._cache: dict[tuple[int, int], float] = {}  # interpolated lookups (decide's hot path)
        self._online: dict[int, dict[int, float]] = defaultdict(dict)  # bs -> k -> median
        self._samples: dict[tuple[int, int], deque[float]] = {}  # the last `window` cycles
        self._online_n: Counter[tuple[int, int]] = Counter()
        self.window = _check_int("window", window, 1)
        if costs is not None:
            if not isinstance(costs, Mapping):
                raise ValueError(f"costs: expected a mapping {{(padded_bs, k): ms}}, got "
                                 f"{type(costs).__name__}")
            checked = [self._checked(key, ms) for key, ms in costs.items()]
            for bs, k, ms in checked:
                self._by_k[k][bs] = ms

    @staticmethod
    def _checked(key: Any, ms: Any) -> tuple[int, int, float]:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"costs: expected keys (padded_bs, k), got {key!r}")
        bs, k = _check_int("padded_bs", key[0], 1), _check_int("k", key[1], 0)
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"cost_ms: expected a finite number > 0 for {(bs, k)}, got {ms!r}")
        return bs, k, float(ms)

    def set(self, padded_bs: int, k: int, ms: float) -> None:
        bs, k, ms = self._checked((padded_bs, k), ms)
        self._by_k[k][bs] = ms
        self._cache.clear()

    def measured(self) -> dict[tuple[int, int], float]:
        """The capture-time entries (not the online medians: `online`)."""
        return {(bs, k): ms for k, row in self._by_k.items() for bs, ms in row.items()}

    def observe(self, padded_bs: int, k: int, ms: float) -> None:
        """One real cycle's device time at (padded_bs, k): the online median (class
        docstring). Bad input raises ValueError and changes nothing."""
        bs, k, ms = self._checked((padded_bs, k), ms)
        window = self._samples.get((bs, k))
        if window is None:
            self._samples[(bs, k)] = window = deque(maxlen=self.window)
        window.append(ms)
        self._online[bs][k] = float(np.median(window))
        self._online_n[(bs, k)] += 1

    def restart(self, padded_bs: int, k: int) -> None:
        """Drop the samples of (padded_bs, k): the next observations form a fresh window (its
        cost stays the old median until the first of them arrives)."""
        window = self._samples.get((padded_bs, k))
        if window is not None:
            window.clear()

    def online(self) -> dict[tuple[int, int], float]:
        """The online cost (median of the last `window` cycles) per (padded_bs, k) observed."""
        return {(bs, k): ms for bs, row in self._online.items() for k, ms in row.items()}

    def online_counts(self) -> dict[tuple[int, int], int]:
        """Real cycles observed per (padded_bs, k)."""
        return dict(self._online_n)

    def timed(self, padded_bs: int, k: int) -> bool:
        """Whether a real cycle at (padded_bs, k) has been observed (no copy of the counts)."""
        return (padded_bs, k) in self._online_n

    def _in_bs(self, row: dict[int, float], bs: int) -> float:
        if bs in row:
            return row[bs]
        xs = sorted(row)
        if len(xs) == 1:
            return row[xs[0]]
        if bs < xs[0]:
            x0, x1 = xs[0], xs[1]
        elif bs > xs[-1]:
            x0, x1 = xs[-2], xs[-1]
        else:
            i = int(np.searchsorted(xs, bs))
            x0, x1 = xs[i - 1], xs[i]
        y0, y1 = row[x0], row[x1]
        y = y0 + (y1 - y0) * (bs - x0) / (x1 - x0)
        nearest = row[x0] if abs(bs - x0) <= abs(bs - x1) else row[x1]
        return max(y, nearest / 1000.0)

    def cost(self, padded_bs: int, k: int) -> float:
        """ms of one cycle at this padded bs with k drafts: the online median of real cycles
        where observed, else the capture-time entry (measured or interpolated)."""
        row = self._online.get(padded_bs)
        if row:
            hit = row.get(k)
            if hit is not None:
                return hit
        base = self._cache.get((padded_bs, k))
        if base is None:
            bs, k = _check_int("padded_bs", padded_bs, 1), _check_int("k", k, 0)
            self._cache[(bs, k)] = base = self._interpolate(bs, k)
        if k == 0 or not row:
            return base
        pos = [j for j in row if j > 0]
        ref = min(pos, key=lambda j: (abs(j - k), j)) if pos else 0
        return base * row[ref] / self.cost_at_capture(padded_bs, ref)

    def cost_at_capture(self, padded_bs: int, k: int) -> float:
        """The capture-time figure (measured or interpolated), ignoring the online costs."""
        hit = self._cache.get((padded_bs, k))
        if hit is None:
            bs, k = _check_int("padded_bs", padded_bs, 1), _check_int("k", k, 0)
            self._cache[(bs, k)] = hit = self._interpolate(bs, k)
        return hit

    def _interpolate(self, bs: int, k: int) -> float:
        if k in self._by_k:
            return self._in_bs(self._by_k[k], bs)
        ks = sorted(self._by_k)
        lo = [x for x in ks if x < k]
        hi = [x for x in ks if x > k]
        if not lo or not hi:
            raise ValueError(f"k: no cost entry for k = {k} and no measured k on both sides "
                             f"(measured k: {ks})")
        k0, k1 = lo[-1], hi[0]
        c0, c1 = self._in_bs(self._by_k[k0], bs), self._in_bs(self._by_k[k1], bs)
        return c0 + (c1 - c0) * (k - k0) / (k1 - k0)


class SpeculationPolicy:
    """Draft steps per padded batch size (module docstring).

    `mode` "fixed" | "adaptive"; `num_steps` S (fixed mode's k, and the largest draft length);
    `steps` the captured draft lengths the adaptive mode may pick (default 0..S; must hold 0 and
    lie in 0..S); `costs` a `CostTable` or mapping (adaptive mode needs one covering `steps`);
    `hysteresis` relative margin >= 0 between two k > 0; `spec_margin` >= 0 the relative
    margin by which a k > 0 must beat k = 0 to be picked or kept; `probe_every` decisions (0:
    never probe); `probe_budget` the fraction of target-only time probes may cost;
    `probe_cycles` >= 1 consecutive k > 0 decisions per probe (2: the first verifies the
    filler a k = 0 cycle left); `cost_probe_margin` >= 0: while a k > 0 is chosen, an eligible
    other k > 0 whose score lies within this margin below the chosen one's runs once (a cost
    probe) when its cost at this bs is still extrapolated (no real cycle timed), so that two
    close k are compared on measured costs, not on an extrapolation (0: never);
    `cost_probe_cycles` >= 1 consecutive cycles per cost probe (the median of a fresh window);
    `cost_refresh` >= 0, `cost_refresh_budget` >= 0: the refresh interval (`refresh_interval`;
    `cost_refresh` 0 or budget 0: no refresh).
    """

    def __init__(self, mode: str, num_steps: int, costs: CostTable | Mapping | None = None, *,
                 steps: Iterable[int] | None = None, estimator: AcceptRateEstimator | None = None,
                 hysteresis: float = 0.03, spec_margin: float = 0.02, probe_every: int = 16,
                 probe_budget: float = 0.003, probe_cycles: int = 2,
                 cost_probe_margin: float = 0.1, cost_probe_cycles: int = 3,
                 cost_refresh: int = 16, cost_refresh_budget: float = 0.005) -> None:
        self.mode = check_speculative_policy(mode)
        self.num_steps = _check_int("num_steps", num_steps, 0)
        steps = list(range(self.num_steps + 1)) if steps is None else list(steps)
        for s in steps:
            _check_int("steps", s, 0)
        if not steps or len(set(steps)) != len(steps) or max(steps) > self.num_steps or (
                self.mode == "adaptive" and 0 not in steps):
            raise ValueError(f"steps: expected distinct ints in 0..{self.num_steps} including 0 "
                             f"(adaptive), got {steps}")
        self.steps = sorted(int(s) for s in steps)
        if costs is not None and not isinstance(costs, CostTable):
            costs = CostTable(costs)
        if self.mode == "adaptive":
            if costs is None:
                raise ValueError("costs: the adaptive policy needs the measured cost table")
            if not costs.measured():
                raise ValueError("costs: expected at least one measured (padded_bs, k) entry")
            for k in self.steps:  # every captured k must be priceable (raises naming k)
                costs.cost(1, k)
        self.hysteresis = _check_margin("hysteresis", hysteresis)
        self.spec_margin = _check_margin("spec_margin", spec_margin)
        self.costs = costs
        self.estimator = estimator if estimator is not None else AcceptRateEstimator()
        if not isinstance(self.estimator, AcceptRateEstimator):
            raise ValueError(f"estimator: expected an AcceptRateEstimator, got "
                             f"{type(self.estimator).__name__}")
        self.probe_every = _check_int("probe_every", probe_every, 0)
        self.probe_budget = _check_margin("probe_budget", probe_budget)
        self.probe_cycles = _check_int("probe_cycles", probe_cycles, 1)
        self.cost_probe_margin = _check_margin("cost_probe_margin", cost_probe_margin)
        self.cost_probe_cycles = _check_int("cost_probe_cycles", cost_probe_cycles, 1)
        self.cost_refresh = _check_int("cost_refresh", cost_refresh, 0)
        self.cost_refresh_budget = _check_margin("cost_refresh_budget", cost_refresh_budget)
        self.reset_stats()

    def reset_stats(self) -> None:
        self._current: dict[int, int] = {}
        self._chosen: dict[int, Counter[int]] = defaultdict(Counter)
        self._switches: Counter[int] = Counter()
        self._probes = 0
        self._cost_probed: set[tuple[int, int]] = set()  # (bs, k) run once for their cost
        self._cost_refreshes = 0
        self._cost_probe_left: dict[int, tuple[int, int]] = {}  # bs -> (j, cycles still to run)
        self._decisions: Counter[int] = Counter()  # bs -> decisions so far
        self._last_run: dict[tuple[int, int], int] = {}  # (bs, k) -> decision index it last ran
        self._since_info = 0
        self._probe_left: dict[int, int] = {}  # bs -> probe decisions still to return

    # ------------------------------------------------------------------
    def scores(self, padded_bs: int, alpha: float | None = None,
               extra_ms: float = 0.0) -> dict[int, float]:
        """Expected tokens per ms per row for every k of `steps` at this bs (alpha: the
        estimate; `extra_ms` added to every k's cost: work the table leaves out that is the
        same for every k, e.g. the KV reads of the batch's contexts)."""
        a = self.estimator.alpha if alpha is None else alpha
        return {k: expected_tokens(a, k) / (self.costs.cost(padded_bs, k) + extra_ms)
                for k in self.steps}

    def _eligible(self, point: dict[int, float], upper: dict[int, float]) -> list[int]:
        """k = 0, and each k > 0 that (safety) beats k = 0 at alpha's upper bound and (margin)
        beats it by `spec_margin` at the point estimate."""
        return [k for k in self.steps if k == 0 or (
            upper[k] > upper[0] and point[k] >= point[0] * (1.0 + self.spec_margin))]

    def best(self, padded_bs: int, extra_ms: float = 0.0) -> int:
        """The adaptive choice without hysteresis or probing: the eligible k (`_eligible`) of
        maximal score (the smallest on ties); 0 when no k > 0 is eligible."""
        point = self.scores(padded_bs, extra_ms=extra_ms)
        upper = self.scores(padded_bs, self.estimator.upper_bound(), extra_ms)
        return max(self._eligible(point, upper), key=lambda k: (point[k], -k))

    def decide(self, padded_bs: int, extra_ms: float = 0.0) -> int:
        """Draft steps for the next cycle at this padded bs (recorded in `stats()`);
        `extra_ms` >= 0: see `scores`."""
        bs = _check_int("padded_bs", padded_bs, 1)
        if isinstance(extra_ms, bool) or not isinstance(extra_ms, (int, float)) \
                or not math.isfinite(extra_ms) or extra_ms < 0:
            raise ValueError(f"extra_ms: expected a finite number >= 0, got {extra_ms!r}")
        if self.mode == "fixed":
            k = self._settle(bs, self.num_steps)
        else:
            k = self._adaptive(bs, extra_ms)
        self._chosen[bs][k] += 1
        self._last_run[(bs, k)] = self._decisions[bs]
        self._decisions[bs] += 1
        return k

    def _adaptive(self, bs: int, extra_ms: float) -> int:
        """The adaptive mode's k (module docstring: eligibility, hysteresis, probes, cost
        probes); probes and cost probes leave the bs's current choice alone."""
        point = self.scores(bs, extra_ms=extra_ms)
        upper = self.scores(bs, self.estimator.upper_bound(), extra_ms)
        eligible = self._eligible(point, upper)
        k = max(eligible, key=lambda j: (point[j], -j))
        cur = self._current.get(bs)
        if cur and k and cur != k and cur in eligible \
                and point[k] <= point[cur] * (1.0 + self.hysteresis):
            k = cur  # between two k > 0, not better by the margin: stay
        if k == 0 and self._probe_left.get(bs, 0) > 0:  # the probe's later cycles
            self._probe_left[bs] -= 1
            return self.steps[1]
        self._probe_left.pop(bs, None)  # k > 0 chosen: no probe needed
        j = self._cost_probe(bs, k, point, eligible) if k else None
        if j is not None:
            return j
        if k == 0 and self.probe_every and len(self.steps) > 1 \
                and self._since_info >= self.probe_interval(bs, extra_ms):
            self._probes += 1
            self._since_info = 0
            self._probe_left[bs] = self.probe_cycles - 1
            return self.steps[1]
        self._since_info += 1
        if k == 0:
            self.estimator.age()
        return self._settle(bs, k)

    def _settle(self, bs: int, k: int) -> int:
        """k becomes the bs's current choice (a switch counted when it changes)."""
        prev = self._current.get(bs)
        if prev is not None and prev != k:
            self._switches[bs] += 1
        self._current[bs] = k
        return k

    def _cost_probe(self, bs: int, k: int, point: dict[int, float],
                    eligible: list[int]) -> int | None:
        """A j > 0 to run instead of the chosen k for its cost (class docstring): the next cycle
        of a cost probe in progress; else an eligible j != k whose score is within
        `cost_probe_margin` of k's and whose cost at `bs` no real cycle has measured yet (each
        (bs, j) once), or that has not run for `refresh_interval` decisions (a refresh: its
        old samples are dropped, `CostTable.restart`)."""
        if not self.cost_probe_margin:
            return None
        left = self._cost_probe_left.pop(bs, None)
        if left is not None and left[0] in eligible and left[0] != k:
            if left[1] > 1:
                self._cost_probe_left[bs] = (left[0], left[1] - 1)
            return left[0]
        now = self._decisions[bs]
        for j in eligible:
            if not j or j == k or point[j] < point[k] * (1.0 - self.cost_probe_margin):
                continue
            if not self.costs.timed(bs, j):
                if (bs, j) in self._cost_probed:
                    continue  # its probe cycles are still in flight
                self._cost_probed.add((bs, j))
            elif now - self._last_run.get((bs, j), 0) >= self.refresh_interval(point, k, j):
                self._cost_refreshes += 1
                self.costs.restart(bs, j)
            else:
                continue
            if self.cost_probe_cycles > 1:
                self._cost_probe_left[bs] = (j, self.cost_probe_cycles - 1)
            return j
        return None

    def refresh_interval(self, point: dict[int, float], k: int, j: int) -> float:
        """Decisions between cost refreshes of j while k is chosen: `cost_probe_cycles` cycles
        that lose 1 - point[j] / point[k] each cost at most `cost_refresh_budget` of the time,
        and never more often than every `cost_refresh` decisions (inf: refresh off)."""
        if not self.cost_refresh or not self.cost_refresh_budget:
            return math.inf
        loss = max(1.0 - point[j] / point[k], 0.0) * self.cost_probe_cycles
        return max(self.cost_refresh, math.ceil(loss / self.cost_refresh_budget - 1e-9))

    def probe_interval(self, padded_bs: int, extra_ms: float = 0.0) -> int:
        """Decisions without information before a probe at this bs: `probe_every`, stretched so
        that probing costs at most `probe_budget` of the target-only time. A probe of the
        smallest k1 > 0 (cost ratio r = cost(bs, k1) / cost(bs, 0), `extra_ms` added to both)
        loses, in k = 0 cycles, r - 1 on its first cycle (it verifies filler: one token a row)
        and max(r - E(alpha, k1), 0) on each later one, priced at alpha's Wilson LOWER bound
        (`AcceptRateEstimator.lower_bound`), not its point estimate: the point estimate of a
        useless head keeps its prior's residue (aging scales successes and trials alike), so
        it would price probes as nearly free and probe every `probe_every` decisions; the
        lower bound falls to 0 over a k = 0 stretch (aging shrinks the trial count), where
        a probe's price is its worst case probe_cycles * (r - 1). The further the rate lies
        below break-even, the rarer the probes."""
        if len(self.steps) < 2 or self.costs is None:
            return self.probe_every
        k1 = self.steps[1]
        r = (self.costs.cost(padded_bs, k1) + extra_ms) / (self.costs.cost(padded_bs, 0) + extra_ms)
        gain = expected_tokens(self.estimator.lower_bound(), k1)
        loss = max(r - 1.0, 0.0) + (self.probe_cycles - 1) * max(r - gain, 0.0)
        if self.probe_budget <= 0 or loss <= 0:
            return self.probe_every
        return max(self.probe_every, math.ceil(loss / self.probe_budget - 1e-9))  # fp slack

    def observe(self, accept_lengths: Any, k: int, slots: Any = None) -> None:
        """Accept lengths `[rows]` of one verify with k drafts (the k that verify ran with,
        whatever has been decided since); see `AcceptRateEstimator.observe`."""
        self.estimator.observe(accept_lengths, k, slots)
        if k > 0 and len(accept_lengths):
            self._since_info = 0

    def observe_cost(self, padded_bs: int, k: int, ms: float, extra_ms: float = 0.0) -> None:
        """The device time `ms` of one real cycle at (padded_bs, k), read when it was retired
        (host floats, no sync); `extra_ms` the KV-read term `decide` was given for it, taken
        out so that the online cost stays comparable with the capture-time table (the term
        is added back to every k at decision time). Feeds `CostTable.observe`; a policy
        without a cost table (fixed) ignores it. ValueError on a bad value."""
        bs, k = _check_int("padded_bs", padded_bs, 1), _check_int("k", k, 0)
        for name, x in (("ms", ms), ("extra_ms", extra_ms)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
                    or x < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {x!r}")
        if self.costs is None or ms <= 0:
            return
        self.costs.observe(bs, k, max(float(ms) - float(extra_ms), float(ms) * 0.05))

    def stats(self) -> dict[str, Any]:
        """Decisions for metrics, as a plain dict."""
        return {
            "mode": self.mode,
            "alpha": self.estimator.alpha,
            "alpha_upper": self.estimator.upper_bound(),
            "observed_rows": self.estimator.observed_rows,
            "steps_chosen": {bs: dict(sorted(c.items())) for bs, c in sorted(self._chosen.items())},
            "current": dict(sorted(self._current.items())),
            "switches": dict(sorted(self._switches.items())),
            "probes": self._probes,
            "cost_probes": sorted(self._cost_probed),
            "cost_refreshes": self._cost_refreshes,
            "cost_ms_online": self._online_costs(),
        }

    def _online_costs(self) -> dict[int, dict[int, float]]:
        """The cost table's online costs as {k: {padded bs: ms}} ({} without a table)."""
        out: dict[int, dict[int, float]] = {}
        if self.costs is not None:
            for (bs, k), ms in sorted(self.costs.online().items()):
                out.setdefault(k, {})[bs] = round(ms, 5)
        return dict(sorted(out.items()))


def _check_margin(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {x!r}")
    return float(x)


ANALYTIC_BANDWIDTH = 4.0e12
"""Bytes/s of the analytic cost model (about an H200's measured copy bandwidth)."""
ANALYTIC_FLOPS = 6.0e14
"""Matmul flop/s of the analytic cost model (dense bf16, well below an H200's peak)."""
ANALYTIC_LAYER_MS = 0.01
"""Fixed ms per decoder layer per forward of the analytic cost model (the launch gaps and small
kernels of a layer: a 32-layer target pays 32 of them, a one-layer draft step one)."""


def _forward_ms(weight_bytes: float, params: float, layers: int, tokens: int) -> float:
    """One forward over `tokens` tokens: weights read once or matmul flops, whichever binds,
    plus the layers' fixed cost."""
    return max(weight_bytes / ANALYTIC_BANDWIDTH, 2.0 * params * tokens / ANALYTIC_FLOPS) * 1e3 \
        + layers * ANALYTIC_LAYER_MS


def analytic_cost_table(target: Any, head: Any, batch_sizes: Iterable[int],
                        steps: Iterable[int]) -> dict[tuple[int, int], float]:
    """The documented fallback cost `{(padded_bs, k): ms}` where nothing can be timed (CPU,
    enforce-eager, graphs off): a roofline of the cycle's forwards from the models' parameter
    counts (`target`, `head`: modules; head None: no draft work),
      verify       one target forward over bs * (k + 1) tokens
      first step   one head forward over bs * (k + 1) tokens; k = 0: the KV-only step over bs
                   tokens (`Eagle3DraftHead.store_kv`: fc, the input norms, qkv; it keeps the
                   draft KV complete; deferred by default, `runtime/deferred_kv.py`, where a
                   k = 0 cycle pays about a P-th of one over bs * P tokens: this nominal table
                   keeps the whole step, a slight overprice of k = 0 on a CPU)
      multi-step   k - 1 head forwards over bs tokens
    each max(weight bytes / ANALYTIC_BANDWIDTH, 2 * params * tokens / ANALYTIC_FLOPS) +
    layers * ANALYTIC_LAYER_MS (`config.num_hidden_layers`, 1 without a config). Attention and KV reads are left out (the same for every k to first
    order), and so are embedding tables. Nominal H200-like constants: the decisions it gives on a CPU are what such a
    machine would roughly prefer, not measurements."""
    def layers(m: Any) -> int:
        return int(getattr(getattr(m, "config", None), "num_hidden_layers", 1) or 1)

    def size(m: Any, only: tuple[str, ...] | None = None) -> tuple[float, float]:
        seen, nbytes, params = set(), 0, 0
        for name, p in m.named_parameters():
            if "embed" in name:  # a lookup reads a few rows, not the table
                continue
            if only is not None and not name.startswith(only):
                continue
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                nbytes += p.numel() * p.element_size()
                params += p.numel()
        return float(nbytes), float(params)

    tb, tp = size(target)
    hb, hp = size(head) if head is not None else (0.0, 0.0)
    kv_only = ("fc", "midlayer.input_layernorm", "midlayer.hidden_norm",
               "midlayer.self_attn.qkv_proj")
    kb, kp = size(head, kv_only) if head is not None else (0.0, 0.0)
    tl, hl = layers(target), (layers(head) if head is not None else 0)
    out = {}
    for bs in batch_sizes:
        bs = _check_int("batch_sizes", bs, 1)
        for k in steps:
            k = _check_int("steps", k, 0)
            ms = _forward_ms(tb, tp, tl, bs * (k + 1))
            if head is not None and k == 0:
                ms += _forward_ms(kb, kp, hl, bs)
            elif head is not None:
                ms += _forward_ms(hb, hp, hl, bs * (k + 1)) \
                    + max(k - 1, 0) * _forward_ms(hb, hp, hl, bs)
            out[(bs, k)] = ms
    return out


def save_costs(path, table: Mapping[tuple[int, int], float]) -> bool:
    """Write a capture-time cost table `{(padded_bs, k): ms}` to `path` (JSON, atomically);
    False when the folder is not writable (the next start measures again)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"costs": [[bs, k, ms] for (bs, k), ms in sorted(table.items())]}))
        tmp.replace(path)
    except OSError:
        return False
    return True


def load_costs(path, cells) -> dict[tuple[int, int], float] | None:
    """The table `save_costs` wrote at `path` when it has every (padded_bs, k) of `cells`
    with a valid cost; None otherwise (no file, unreadable, another schedule)."""
    if path is None:
        return None
    try:
        rows = json.loads(Path(path).read_text())["costs"]
        table = {(int(bs), int(k)): float(ms) for bs, k, ms in rows}
        CostTable(table)  # validates every entry
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return table if all(c in table for c in cells) else None


def measure_replay_ms(replay: Callable[[], Any], warmup: int = 3, iters: int = 20) -> float:
    """Median device time (ms) of `replay()` (a captured graph's replay, or any launch sequence)
    timed with CUDA events on the current stream: the capture-time cost of one configuration."""
    import torch

    warmup, iters = _check_int("warmup", warmup, 0), _check_int("iters", iters, 1)
    if not torch.cuda.is_available():
        raise ValueError("replay: measure_replay_ms needs a CUDA device (timings are device times)")
    for _ in range(warmup):
        replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


class CycleTimer:
    """Device time of launched cycles, read one step late without a sync.

    `begin(slot)` / `end(slot)` record a pair of timing events on the current stream around one
    launch; `elapsed_ms(slot)` returns the ms between them once the end event has completed
    (`event.query()`, which never waits), else None, and disarms the slot (each launch is read
    once). Slots are the Engine's two pinned-pack ring slots: a slot is reused only after the
    step that used it was retired, so the events are never re-recorded before they are read.
    `event_factory()` makes one timing event (default `torch.cuda.Event(enable_timing=True)`;
    CPU tests inject host fakes with `record`, `query` and `elapsed_time`)."""

    def __init__(self, slots: int = 2, event_factory: Callable[[], Any] | None = None) -> None:
        slots = _check_int("slots", slots, 1)
        if event_factory is None:
            import torch

            def event_factory() -> Any:
                return torch.cuda.Event(enable_timing=True)
        self._events = [(event_factory(), event_factory()) for _ in range(slots)]
        self._armed = [False] * slots

    def _slot(self, slot: Any) -> int:
        slot = _check_int("slot", slot, 0)
        if slot >= len(self._events):
            raise ValueError(f"slot: expected < {len(self._events)}, got {slot}")
        return slot

    def begin(self, slot: int) -> None:
        slot = self._slot(slot)
        self._armed[slot] = False
        self._events[slot][0].record()

    def end(self, slot: int) -> None:
        slot = self._slot(slot)
        self._events[slot][1].record()
        self._armed[slot] = True

    def elapsed_ms(self, slot: int) -> float | None:
        """ms from `begin` to `end` of the last launch in this slot, or None (not armed, or
        not completed yet: nothing waits)."""
        slot = self._slot(slot)
        if not self._armed[slot]:
            return None
        start, end = self._events[slot]
        if not end.query():
            return None
        self._armed[slot] = False
        return float(start.elapsed_time(end))
