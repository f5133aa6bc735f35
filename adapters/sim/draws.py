"""The realized world of a scenario: every random quantity, drawn once per seed.

A run's randomness is a few numbered sequences, each from its own ``random.Random`` stream seeded
by the scenario's seed and the sequence's name (string seeds are hashed with SHA-512, independent
of ``PYTHONHASHSEED``):

* per pool, the k-th group started gets the k-th latency factor (mean 1), whatever the controller
  did before it: a group's latency is the pool's mean latency at its start times that factor;
* per pool, the k-th worker spawned gets the k-th start-up factor (mean 1);
* the trainer's k-th step gets the k-th step factor (mean 1).

So the same seed gives the same realized world under every controller, and the oracles
(:mod:`adapters.sim.oracle`) reason about the very draws a controller met, not about their means.
A factor is exactly 1 (no draw) when its spread is 0.
"""

from __future__ import annotations

import math
import random

from adapters.sim.scenario import EnvPool, Scenario

__all__ = ["Draws"]


class _Stream:
    """The numbered factors of one sequence, drawn on demand and kept."""

    __slots__ = ("_draw", "_rng", "values")

    def __init__(self, seed: str, draw: str, spread: float) -> None:
        self._rng = random.Random(seed)
        self._draw = (draw, spread)
        self.values: list[float] = []

    def get(self, k: int) -> float:
        values = self.values
        while len(values) <= k:
            values.append(self._next())
        return values[k]

    def _next(self) -> float:
        kind, spread = self._draw
        if kind == "pareto":  # tail index `spread`, scaled to mean 1
            return (spread - 1) / spread * self._rng.paretovariate(spread)
        if spread == 0:
            return 1.0
        return math.exp(self._rng.normalvariate(-spread * spread / 2, spread))


class Draws:
    """The random factors of one scenario's realized world (see the module docstring)."""

    def __init__(self, scenario: Scenario) -> None:
        seed = scenario.seed
        self._latency: dict[str, _Stream] = {}
        self._startup: dict[str, _Stream] = {}
        for pool in scenario.pools:
            kind, spread = _latency_law(pool)
            self._latency[pool.name] = _Stream(f"deo-sim:{seed}:{pool.name}:latency", kind, spread)
            self._startup[pool.name] = _Stream(
                f"deo-sim:{seed}:{pool.name}:startup", "lognormal", pool.startup_sigma
            )
        self._step = _Stream(
            f"deo-sim:{seed}:trainer:step", "lognormal", scenario.trainer.step_sigma
        )

    def latency_factor(self, pool: str, k: int) -> float:
        """The k-th (from 0) group of ``pool``: its latency over the pool's mean at its start."""
        return self._latency[pool].get(k)

    def latency_factors(self, pool: str, count: int) -> list[float]:
        """The first ``count`` latency factors of ``pool``."""
        stream = self._latency[pool]
        if count > 0:
            stream.get(count - 1)
        return stream.values[:count]

    def startup_factor(self, pool: str, k: int) -> float:
        """The k-th (from 0) worker spawned in ``pool``: its start-up over ``startup_s``."""
        return self._startup[pool].get(k)

    def step_factor(self, k: int) -> float:
        """The trainer's k-th (from 0) step: its duration over the phase's ``step_s``."""
        return self._step.get(k)


def _latency_law(pool: EnvPool) -> tuple[str, float]:
    if pool.latency_dist == "pareto":
        return "pareto", pool.latency_alpha
    return "lognormal", pool.latency_sigma
