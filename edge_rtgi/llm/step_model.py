"""An online model of what one engine step costs, for the ``slo`` scheduling policy. No torch.

A step's run time is modelled as linear in what it computes:

    step_ms ~ fixed + per_decode_row * decode_rows + per_prefill_token * prefill_tokens
              + per_context_ktoken * context_tokens / 1000

(``context_tokens``: positions attended to by the step's rows, the attention part.) The
coefficients are fitted by recursive least squares with exponential forgetting, so the model
follows the machine as its load changes. Each observation is first predicted and the error
recorded, so ``error_ms``/``error_pct`` are out-of-sample figures of how far to trust it.
"""

from __future__ import annotations

from dataclasses import dataclass

FEATURES = ("fixed", "per_decode_row", "per_prefill_token", "per_context_ktoken")
RESIDUAL_CLIP = 4.0  # a residual counts at most this many mean absolute errors
RESIDUAL_FLOOR_MS = 2.0


@dataclass(frozen=True)
class StepShape:
    """What a step computes: rows that sample after one token, other tokens, attended positions."""

    decode_rows: int
    prefill_tokens: int
    context_tokens: int

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.decode_rows), float(self.prefill_tokens), self.context_tokens / 1e3)


@dataclass(frozen=True)
class StepModelSnapshot:
    """The fitted coefficients (ms per unit, in ``FEATURES`` order) and the prediction error
    (mean absolute, over recent steps, predicted before each was observed)."""

    coefficients_ms: tuple[float, ...]
    num_observations: int
    error_ms: float
    error_pct: float
    ready: bool


class StepTimeModel:
    """Online least-squares fit of step time; ``predict_ms`` is None until ``min_observations``."""

    def __init__(self, forgetting: float = 0.995, min_observations: int = 16, prior_var: float = 1e4):
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting}")
        n = len(FEATURES)
        self.forgetting = forgetting
        self.min_observations = min_observations
        self._theta = [0.0] * n
        # inverse information matrix of recursive least squares, started wide (weak prior at 0)
        self._prior_var = prior_var
        self._p = [[prior_var if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.num_observations = 0
        self._abs_err_ms = 0.0
        self._abs_err_rel = 0.0
        self._err_weight = 0.0
        self._clip_scale_ms = 0.0

    @property
    def ready(self) -> bool:
        return self.num_observations >= self.min_observations

    def predict_ms(self, shape: StepShape) -> float | None:
        """Predicted run time of a step of this shape, or None while the model is still learning."""
        if not self.ready:
            return None
        return max(0.0, self._dot(shape.features()))

    def marginal_ms(self, feature: str) -> float:
        """Fitted cost of one more unit of ``feature`` (ms), never below 0."""
        return max(0.0, self._theta[FEATURES.index(feature)])

    def observe(self, shape: StepShape, run_ms: float) -> None:
        """Learn from one measured step.

        A step stalled by something outside the engine (another process, a page fault storm)
        would drag a least-squares fit far off, so a residual counts at most a few times the
        typical error (a Huber-style clip) once the model is ready.
        """
        x = shape.features()
        predicted = self._dot(x)
        residual = run_ms - predicted
        if self.ready:  # errors only of predictions the scheduler would have used
            decay = self.forgetting
            self._abs_err_ms = decay * self._abs_err_ms + abs(residual)
            self._abs_err_rel = decay * self._abs_err_rel + abs(residual) / max(run_ms, 1e-3)
            self._err_weight = decay * self._err_weight + 1.0
            # the clip's scale follows the clipped residuals, so stalls cannot widen it
            scale = self._clip_scale_ms / self._err_weight if self._err_weight else 0.0
            bound = max(RESIDUAL_FLOOR_MS, RESIDUAL_CLIP * scale)
            residual = max(-bound, min(bound, residual))
            self._clip_scale_ms = decay * self._clip_scale_ms + abs(residual)
        self._rls_update(x, residual)
        self.num_observations += 1

    def snapshot(self) -> StepModelSnapshot:
        w = self._err_weight
        return StepModelSnapshot(
            coefficients_ms=tuple(self._theta),
            num_observations=self.num_observations,
            error_ms=self._abs_err_ms / w if w else 0.0,
            error_pct=100.0 * self._abs_err_rel / w if w else 0.0,
            ready=self.ready,
        )

    def _dot(self, x: tuple[float, ...]) -> float:
        return sum(t * v for t, v in zip(self._theta, x, strict=True))

    def _rls_update(self, x: tuple[float, ...], residual: float) -> None:
        n, lam, p = len(x), self.forgetting, self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]  # P x
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        self._theta = [t + g * residual for t, g in zip(self._theta, gain, strict=True)]
        # P <- (P - k x^T P) / lambda; P stays symmetric, so x^T P = (P x)^T. Forgetting inflates
        # P along directions the steps do not excite; capping its diagonal at the prior keeps
        # those from winding up into wild coefficients at the next unusual step.
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        for i in range(n):
            if new_p[i][i] > self._prior_var:
                scale = (self._prior_var / new_p[i][i]) ** 0.5
                for j in range(n):
                    new_p[i][j] *= scale
                    new_p[j][i] *= scale
        self._p = new_p
