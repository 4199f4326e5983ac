"""Bit allocation: choose a scheme per group that minimises summed sensitivity under a byte budget.

Greedy by marginal KL per byte: every group starts at its cheapest candidate; then, repeatedly,
the single upgrade (one group to any dearer candidate with lower KL) that removes the most KL
per extra byte and still fits the budget is taken, until none fits. With per-group KLs treated
as additive (the first-order assumption all sensitivity-based allocators make, HAWQ included)
this is the classic greedy for a multiple-choice knapsack. It is within one item of the LP
optimum when each group's (bytes, KL) curve is convex, and it is cheap enough to re-run for any
budget. An exact DP over bytes would gain little: the error in the additivity assumption is
larger than the greedy's gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.quant.plan import QuantPlan, WeightGroup, plan_nbytes
from edge_rtgi.llm.quant.profile import SensitivityTable
from edge_rtgi.llm.quant.schemes import parse_scheme


@dataclass(frozen=True)
class Budget:
    """A byte budget, from an average bits-per-weight target or a size cap in MB (10^6 bytes)."""

    max_bytes: int
    described: str

    @classmethod
    def from_args(cls, groups: list[WeightGroup], target_bits: float | None, max_mb: float | None) -> Budget:
        if (target_bits is None) == (max_mb is None):
            raise ConfigError("give exactly one budget: --target-bits B or --max-mb N")
        if target_bits is not None:
            if target_bits <= 0:
                raise ConfigError(f"--target-bits must be positive, got {target_bits}")
            numel = sum(g.numel for g in groups)
            return cls(int(target_bits * numel / 8), f"{target_bits} bits per weight")
        if max_mb <= 0:
            raise ConfigError(f"--max-mb must be positive, got {max_mb}")
        return cls(int(max_mb * 1e6), f"{max_mb} MB")


def _candidates(group: WeightGroup, table: SensitivityTable, schemes: tuple[str, ...] | None) -> list:
    """(bytes, kl, name) options for a group, dominated ones removed, cheapest first."""
    measured = table.kl.get(group.name)
    if measured is None:
        raise ConfigError(f"the sensitivity table has no row for {group.name}",
                          hint="profile this model again with edge-rtgi quantize --profile")
    # "none" (bf16) is a candidate only when asked for: its KL is exactly 0 by construction, while
    # every measured trial carries the bf16 noise floor (~1e-3 nats on SmolLM2), so it would look
    # better than it is next to int8.
    options = {**measured, **({"none": 0.0} if schemes and "none" in schemes else {})}
    rows = []
    for name, kl in options.items():
        scheme = parse_scheme(name)
        if (schemes is None or name in schemes) and group.allowed(scheme):
            rows.append((scheme.nbytes(group.out_features, group.in_features), kl, name))
    rows.sort()
    kept, best = [], float("inf")
    for row in rows:  # keep only options that are cheaper than every option with lower KL
        if row[1] < best:
            kept.append(row)
            best = row[1]
    return kept


def allocate(groups: list[WeightGroup], table: SensitivityTable, budget: Budget,
             schemes: tuple[str, ...] | None = None) -> QuantPlan:
    """The plan minimising summed KL within ``budget``; ``schemes`` limits the candidates."""
    options = {g.name: _candidates(g, table, schemes) for g in groups}
    empty = [name for name, rows in options.items() if not rows]
    if empty:
        raise ConfigError(f"no allowed candidate scheme for {', '.join(empty)}")
    choice = {name: 0 for name in options}
    used = sum(rows[0][0] for rows in options.values())
    numel = sum(g.numel for g in groups)
    if used > budget.max_bytes:
        raise ConfigError(
            f"budget of {budget.described} is below the smallest plan: every group at its cheapest "
            f"candidate needs {8 * used / numel:.3f} bits per weight ({used / 1e6:.2f} MB)",
            hint=f"use --target-bits >= {8 * used / numel:.3f} or --max-mb >= {used / 1e6:.2f}",
        )
    while True:
        best = None
        for name, rows in options.items():
            cur_bytes, cur_kl, _ = rows[choice[name]]
            for j in range(choice[name] + 1, len(rows)):
                extra = rows[j][0] - cur_bytes
                if used + extra <= budget.max_bytes:
                    gain = (cur_kl - rows[j][1]) / extra
                    if best is None or gain > best[0]:
                        best = (gain, name, j, extra)
        if best is None:
            break
        _, name, j, extra = best
        choice[name] = j
        used += extra
    resolved = {name: options[name][choice[name]][2] for name in options}
    total_kl = sum(options[name][choice[name]][1] for name in options)
    notes = {"budget": budget.described, "bits_per_weight": round(8 * plan_nbytes(resolved, groups) / numel, 4),
             "size_mb": round(plan_nbytes(resolved, groups) / 1e6, 3), "predicted_kl_sum": float(f"{total_kl:.4g}")}
    return QuantPlan(resolved, "none", notes)
