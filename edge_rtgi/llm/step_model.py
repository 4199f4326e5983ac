"""An online model of what one engine step costs, for the ``slo`` scheduling policy. No torch.

A step's run time is modelled as linear in what it computes:

    step_ms ~ fixed + per_decode_row * decode_rows + per_prefill_token * prefill_tokens
              + per_context_ktoken * context_tokens / 1000 + python_layers * [Python layers ran]

(``context_tokens``: positions attended to by the step's rows, the attention part.) On the CPU a
step of one-token rows (decodes, verification, small prompt chunks) runs the layer stack as one
C++ call, any other step the Python layers, which cost a fixed 9-40 ms more per step on a
2-core machine (docs/benchmarks.md): a cost of its own, not one a per-token slope can carry. The
coefficients are a ridge least-squares fit over the last ``window`` steps, refitted every
``refit_every`` steps, so the model follows the machine as its load changes. Steps stalled by
something outside the engine (another process, a page-fault storm) would drag a least-squares
fit far off, so the fit is done twice and the second pass leaves out steps whose residual passes
``OUTLIER_FACTOR`` times the median absolute residual. (A recursive fit with forgetting was tried
first: on a shared machine its unexcited directions wound up and its coefficients ran away.)
Each observation is first predicted and the error recorded, so ``error_ms``/``error_pct`` are
out-of-sample figures of how far to trust it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("fixed", "per_decode_row", "per_prefill_token", "per_context_ktoken", "python_layers")
OUTLIER_FACTOR = 4.0
# ``overshoot_ms`` is this quantile of how far recent steps ran past their prediction. A step
# planned that far under an ITL objective misses it 3 % of the time: a 32-token reply judged at
# its 95th-percentile gap may have one late gap in its 31.
OVERSHOOT_QUANTILE = 0.97
_RIDGE = 1e-3  # keeps the solve defined when a feature never varies (no prefill in the window)


@dataclass(frozen=True)
class StepShape:
    """What a step computes: rows that sample after one token, other tokens, attended positions,
    and whether it ran the Python layer stack where a fused decode loop exists (where a runner
    has none, no step is marked: none pays more than another)."""

    decode_rows: int
    prefill_tokens: int
    context_tokens: int
    python_layers: bool = False

    def features(self) -> tuple[float, float, float, float, float]:
        return (
            1.0,
            float(self.decode_rows),
            float(self.prefill_tokens),
            self.context_tokens / 1e3,
            float(self.python_layers),
        )


@dataclass(frozen=True)
class StepModelSnapshot:
    """The fitted coefficients (ms per unit, in ``FEATURES`` order) and the prediction error
    (mean absolute over recent steps, each predicted before it was observed)."""

    coefficients_ms: tuple[float, ...]
    num_observations: int
    error_ms: float
    error_pct: float
    ready: bool
    overshoot_ms: float = 0.0


class StepTimeModel:
    """Windowed robust least-squares fit of step time; ``predict_ms`` is None until
    ``min_observations`` steps were seen."""

    def __init__(self, window: int = 512, refit_every: int = 16, min_observations: int = 16):
        if window < 8 or refit_every < 1 or min_observations < 1:
            raise ValueError("window must be >= 8, refit_every and min_observations >= 1")
        self.window = window
        self.refit_every = refit_every
        self.min_observations = min_observations
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._theta = np.zeros(len(FEATURES))
        self._fitted = False
        self.num_observations = 0
        self._errors_ms: deque[float] = deque(maxlen=window)
        self._errors_rel: deque[float] = deque(maxlen=window)
        self._overshoots_ms: deque[float] = deque(maxlen=window)  # signed: run minus prediction
        self._overshoot_ms = 0.0

    @property
    def ready(self) -> bool:
        return self._fitted and self.num_observations >= self.min_observations

    def predict_ms(self, shape: StepShape) -> float | None:
        """Predicted run time of a step of this shape, or None while the model is still learning."""
        if not self.ready:
            return None
        return max(0.0, float(np.dot(self._theta, shape.features())))

    def marginal_ms(self, feature: str) -> float:
        """Fitted cost of one more unit of ``feature`` (ms), never below 0."""
        return max(0.0, float(self._theta[FEATURES.index(feature)]))

    def overshoot_ms(self) -> float:
        """How far a step runs past its prediction at the ``OVERSHOOT_QUANTILE`` of recent steps
        (never below 0; updated at each refit): the margin a plan needs to keep an objective."""
        return self._overshoot_ms

    def observe(self, shape: StepShape, run_ms: float) -> None:
        """Learn from one measured step."""
        x = shape.features()
        if self.ready:  # errors only of predictions the scheduler would have used
            over = run_ms - float(np.dot(self._theta, x))
            self._overshoots_ms.append(over)
            err = abs(over)
            self._errors_ms.append(err)
            self._errors_rel.append(err / max(run_ms, 1e-3))
        self._x.append(x)
        self._y.append(run_ms)
        self.num_observations += 1
        if self.num_observations >= self.min_observations and self.num_observations % self.refit_every == 0:
            self._refit()

    def snapshot(self) -> StepModelSnapshot:
        n = len(self._errors_ms)
        return StepModelSnapshot(
            coefficients_ms=tuple(float(t) for t in self._theta),
            num_observations=self.num_observations,
            error_ms=sum(self._errors_ms) / n if n else 0.0,
            error_pct=100.0 * sum(self._errors_rel) / n if n else 0.0,
            ready=self.ready,
            overshoot_ms=self._overshoot_ms,
        )

    def _refit(self) -> None:
        x, y = np.array(self._x), np.array(self._y)
        theta = _ridge(x, y)
        residual = np.abs(y - x @ theta)
        keep = residual <= OUTLIER_FACTOR * max(float(np.median(residual)), 1e-6)
        if keep.sum() >= len(FEATURES):
            theta = _ridge(x[keep], y[keep])
        self._theta = theta
        self._fitted = True
        if self._overshoots_ms:
            # stalls from outside the engine (the fit leaves them out too) are no plan's to absorb
            over = np.array(self._overshoots_ms)
            over = over[np.abs(over) <= OUTLIER_FACTOR * max(float(np.median(np.abs(over))), 1e-6)]
            # to the microsecond: a fit's rounding error is no overshoot
            quantile = round(float(np.quantile(over, OVERSHOOT_QUANTILE)), 3) if over.size else 0.0
            self._overshoot_ms = max(0.0, quantile)


def _ridge(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    gram = x.T @ x + _RIDGE * np.eye(x.shape[1])
    return np.linalg.solve(gram, x.T @ y)
