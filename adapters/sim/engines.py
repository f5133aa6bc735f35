"""An engine pool in simulated time: requests arriving, engines with a capacity, sleep and wake.

    deo bench engines [--duration-s S] [--seed N] [--wake-s W] [--cold-start-s C]
    python -m adapters.sim.engines ...   (the same)

Two controllers run the same arrivals (seeded) over the same engines:

- **deo**: the real reducer with an engine pool (``kind = "engine"``, the ``threshold`` policy)
  and deo's router rule: each request to the ACTIVE engine with the fewest in flight; an engine
  leaves routing to drain and sleeps (or stops, past ``max_asleep``) once nothing is in flight;
  scale-up wakes a sleeper before it starts an engine.
- **verl** as published (its ElasticConfig defaults): load ratio = in flight / (active x
  capacity), down below 0.5 and up above 0.8 once 3+ samples in the last 10 s vary by < 0.1,
  cooldowns 60 s down / 30 s up, one engine per decision; scale-down takes the least-loaded
  ACTIVE engine to DRAINING, and at the 30 s drain timeout aborts what is left and releases its
  memory (INACTIVE); scale-up resumes an INACTIVE engine, else cold-starts one; requests are
  spread round-robin over ACTIVE engines.

An engine serves up to ``capacity_per_engine`` requests at full speed; beyond that all of its
requests slow down in proportion (processor sharing). Requests that find no active engine wait in
the router. Printed per controller: requests finished and aborted, latency p50/p99 (arrival to
answer), engine-hours awake (memory held) and starts/wakes.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys

import attrs

from core import (
    Command,
    Config,
    Configured,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    Event,
    LoadSampled,
    PolicySpec,
    PoolSpec,
    Reducer,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)
from core.commands import KillWorker, SleepEngine, SpawnWorker, TerminateWorker, WakeEngine

__all__ = ["HELP", "EngineScenario", "EngineSimResult", "add_arguments", "run", "simulate_engines"]

_STEP_S = 0.25
_FIRST_PORT = 18000


#: The longest engine scenario: a week of simulated time.
MAX_ENGINE_DURATION_S = 7 * 86_400.0


@attrs.frozen(slots=True, kw_only=True)
class EngineScenario:
    """Arrivals and engines: ``rates`` are (from_s, requests per second) steps."""

    duration_s: float = 3600.0
    seed: int = 1
    #: Arrivals begin once the first engines are up (their cold start), so that the start-up wait
    #: does not swamp the comparison.
    rates: tuple[tuple[float, float], ...] = (
        (0, 0.0),
        (200, 2.0),
        (900, 7.0),
        (1800, 1.0),
        (2700, 4.0),
    )
    request_mean_s: float = 20.0
    request_sigma: float = 1.0
    capacity_per_engine: int = 32
    min_engines: int = 2
    max_engines: int = 8
    max_asleep: int = 8
    initial_engines: int = 2
    wake_s: float = 5.0
    cold_start_s: float = 180.0
    sleep_s: float = 1.0
    #: verl's drain timeout; deo's pool uses its own (``deo_drain_timeout_s``): its drains end
    #: when nothing is in flight, so a longer limit costs only the rare long request's wait.
    drain_timeout_s: float = 30.0
    deo_drain_timeout_s: float = 300.0
    sample_interval_s: float = 2.0

    def __attrs_post_init__(self) -> None:
        for name, low, high in (
            ("duration_s", 1.0, MAX_ENGINE_DURATION_S),
            ("wake_s", 0.01, 3600.0),
            ("cold_start_s", 1.0, 3600.0),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: from {low:g} to {high:g} seconds, got {value:g}")

    def rate_at(self, t: float) -> float:
        rate = 0.0
        for start, value in self.rates:
            if t >= start:
                rate = value
        return rate


@attrs.frozen(slots=True, kw_only=True)
class EngineSimResult:
    controller: str
    arrived: int
    finished: int
    aborted: int
    waiting_at_end: int
    latency_p50_s: float
    latency_p99_s: float
    awake_engine_hours: float
    cold_starts: int
    wakes: int


class _Engine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.virtual_s = 0.0
        # (virtual finish, arrival t, request id)
        self.requests: list[tuple[float, float, int]] = []
        self.awake = False  # holds its memory (active, draining, waking counts too)

    @property
    def in_flight(self) -> int:
        return len(self.requests)


class _Load:
    """Arrivals, engines serving them, and what became of each request."""

    def __init__(self, scenario: EngineScenario) -> None:
        self.scenario = scenario
        self.random = random.Random(scenario.seed)
        self.engines: dict[str, _Engine] = {}
        self.waiting: list[tuple[float, float]] = []  # (arrival t, work s) with no engine
        self.latencies: list[float] = []
        self.aborted = 0
        self.next_id = 0
        self.arrived = 0
        self.awake_s = 0.0
        self.cold_starts = 0
        self.wakes = 0
        sigma = scenario.request_sigma
        self._mu = math.log(scenario.request_mean_s) - sigma * sigma / 2

    def arrivals(self, t: float) -> list[float]:
        rate = self.scenario.rate_at(t)
        count = _poisson(self.random, rate * _STEP_S)
        self.arrived += count
        return [
            self.random.lognormvariate(self._mu, self.scenario.request_sigma) for _ in range(count)
        ]

    def admit(self, engine: _Engine, t: float, arrival_t: float, work_s: float) -> None:
        self.next_id += 1
        heapq.heappush(engine.requests, (engine.virtual_s + work_s, arrival_t, self.next_id))

    def advance(self, t: float) -> None:
        capacity = self.scenario.capacity_per_engine
        for engine in self.engines.values():
            if engine.awake:
                self.awake_s += _STEP_S
            n = engine.in_flight
            if not n:
                continue
            engine.virtual_s += _STEP_S * min(1.0, capacity / n)
            while engine.requests and engine.requests[0][0] <= engine.virtual_s:
                _, arrival_t, _ = heapq.heappop(engine.requests)
                self.latencies.append(t + _STEP_S - arrival_t)

    def abort(self, engine: _Engine) -> None:
        self.aborted += len(engine.requests)
        engine.requests = []

    def result(self, controller: str) -> EngineSimResult:
        ordered = sorted(self.latencies) or [0.0]
        return EngineSimResult(
            controller=controller,
            arrived=self.arrived,
            finished=len(self.latencies),
            aborted=self.aborted,
            waiting_at_end=len(self.waiting) + sum(e.in_flight for e in self.engines.values()),
            latency_p50_s=statistics.median(ordered),
            latency_p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            awake_engine_hours=self.awake_s / 3600,
            cold_starts=self.cold_starts,
            wakes=self.wakes,
        )


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: means here are small (a quarter second of arrivals).
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _least_in_flight(engines: list[_Engine]) -> _Engine:
    return min(engines, key=lambda e: e.in_flight)


# --- deo ----------------------------------------------------------------------------------------


def _deo_config(scenario: EngineScenario) -> Config:
    spec = PoolSpec(
        name="gen",
        argv=("engine", "--port", "{port}"),
        kind="engine",
        engine="vllm",
        ports=(_FIRST_PORT, _FIRST_PORT + scenario.max_engines + scenario.max_asleep),
        min_workers=scenario.min_engines,
        max_workers=scenario.max_engines,
        capacity_per_engine=scenario.capacity_per_engine,
        max_asleep=scenario.max_asleep,
        drain_timeout_s=scenario.deo_drain_timeout_s,
        start_timeout_s=scenario.cold_start_s * 4,
        policy=PolicySpec(name="threshold", params={}),
    )
    return Config(pools=(spec,))


def _world_event(what: str, t: float, worker_id: str, pid: int) -> Event:
    """What an engine reports when something the core asked for has happened."""
    if what == "started":
        return WorkerStarted(t=t, worker_id=worker_id, pid=pid, start_time=round(t * 100))
    if what == "ready":
        return WorkerReady(t=t, worker_id=worker_id)
    if what == "asleep":
        return EngineAsleep(t=t, worker_id=worker_id)
    if what == "awake":
        return EngineAwake(t=t, worker_id=worker_id)
    return WorkerExited(t=t, worker_id=worker_id, exit_code=None, signal=15)


def _run_deo(scenario: EngineScenario) -> EngineSimResult:
    load = _Load(scenario)
    reducer = Reducer()
    later: list[tuple[float, int, str, str, int]] = []  # (t, order, what, worker id, pid)
    order = 0
    pids = 0

    def at(t: float, what: str, worker_id: str, pid: int = 0) -> None:
        nonlocal order
        order += 1
        heapq.heappush(later, (t, order, what, worker_id, pid))

    def carry_out(command: Command, t: float) -> None:
        nonlocal pids
        if isinstance(command, SpawnWorker):
            started = _Engine(command.worker_id)
            load.engines[command.worker_id] = started
            started.awake = True
            load.cold_starts += 1
            pids += 1
            at(t + 1.0, "started", command.worker_id, pids)
            at(t + scenario.cold_start_s, "ready", command.worker_id)
        elif isinstance(command, SleepEngine):
            sleeper = load.engines[command.worker_id]
            load.abort(sleeper)  # the sleep call aborts what still runs (nothing, after a drain)
            sleeper.awake = False
            at(t + scenario.sleep_s, "asleep", command.worker_id)
        elif isinstance(command, WakeEngine):
            load.engines[command.worker_id].awake = True
            load.wakes += 1
            at(t + scenario.wake_s, "awake", command.worker_id)
        elif isinstance(command, (TerminateWorker, KillWorker)):
            stopped = load.engines.pop(command.worker_id, None)
            if stopped is not None:
                load.abort(stopped)
            at(t + 0.5, "exited", command.worker_id)

    def feed(event: Event) -> None:
        for command in reducer.step(event):
            carry_out(command, event.t)

    feed(Configured(t=0.0, config=_deo_config(scenario)))
    steps = int(scenario.duration_s / _STEP_S)
    sample_every = max(1, round(scenario.sample_interval_s / _STEP_S))
    for k in range(steps):
        t = k * _STEP_S
        while later and later[0][0] <= t:
            _, _, what, worker_id, pid = heapq.heappop(later)
            feed(_world_event(what, t, worker_id, pid))
        if k % 4 == 0:
            feed(Tick(t=t, interval_s=1.0))
        state = reducer.state
        active = [
            load.engines[w.worker_id]
            for w in state.workers_of("gen")
            if w.state is WorkerState.ACTIVE and w.worker_id in load.engines
        ]
        arrivals = [(t, work) for work in load.arrivals(t)]
        pending = load.waiting + arrivals
        load.waiting = []
        for arrival_t, work in pending:
            if active:
                load.admit(_least_in_flight(active), t, arrival_t, work)
            else:
                load.waiting.append((arrival_t, work))
        load.advance(t)
        if k % sample_every == 0:
            in_flight = len(load.waiting) + sum(e.in_flight for e in load.engines.values())
            feed(LoadSampled(t=t, pool="gen", in_flight_requests=in_flight))
            for worker in reducer.state.workers_of("gen"):
                if worker.state in (WorkerState.GOING_TO_SLEEP, WorkerState.DRAINING):
                    engine = load.engines.get(worker.worker_id)
                    count = engine.in_flight if engine is not None else 0
                    if worker.in_flight_requests != count:
                        feed(
                            EngineLoadSampled(
                                t=t,
                                pool="gen",
                                worker_id=worker.worker_id,
                                in_flight_requests=count,
                            )
                        )
    return load.result("deo")


# --- verl as published ---------------------------------------------------------------------------


def _run_verl(scenario: EngineScenario) -> EngineSimResult:
    load = _Load(scenario)
    states: dict[str, str] = {}
    ready_at: dict[str, float] = {}
    drain_deadline: dict[str, float] = {}
    samples: list[tuple[float, float]] = []
    last_up = last_down = -math.inf
    rr = 0
    for index in range(scenario.initial_engines):
        name = f"gen-{index}"
        load.engines[name] = _Engine(name)
        load.engines[name].awake = True
        states[name] = "starting"
        ready_at[name] = scenario.cold_start_s
        load.cold_starts += 1
    steps = int(scenario.duration_s / _STEP_S)
    sample_every = max(1, round(scenario.sample_interval_s / _STEP_S))
    for k in range(steps):
        t = k * _STEP_S
        for name, when in list(ready_at.items()):
            if when <= t:
                states[name] = "active"
                del ready_at[name]
        for name, deadline in list(drain_deadline.items()):
            engine = load.engines[name]
            if not engine.in_flight or deadline <= t:
                load.abort(engine)  # verl aborts what is left, then releases the memory
                engine.awake = False
                states[name] = "inactive"
                del drain_deadline[name]
        active = [load.engines[n] for n, s in states.items() if s == "active"]
        pending = load.waiting + [(t, work) for work in load.arrivals(t)]
        load.waiting = []
        for arrival_t, work in pending:
            if active:
                rr += 1
                load.admit(active[rr % len(active)], t, arrival_t, work)
            else:
                load.waiting.append((arrival_t, work))
        load.advance(t)
        if k % sample_every:
            continue
        in_flight = len(load.waiting) + sum(e.in_flight for e in load.engines.values())
        ratio = in_flight / (len(active) * scenario.capacity_per_engine) if active else math.inf
        samples = [(st, r) for st, r in samples if st > t - 10.0] + [(t, ratio)]
        values = [r for _, r in samples if math.isfinite(r)]
        stable = len(values) >= 3 and statistics.pvariance(values) < 0.1
        if not (stable or not active):
            continue
        counted = sum(1 for s in states.values() if s in ("active", "starting"))
        if ratio > 0.8 and t - last_up >= 30.0 and counted < scenario.max_engines:
            asleep = [n for n, s in states.items() if s == "inactive"]
            if asleep:
                name = asleep[0]
                load.wakes += 1
                ready_at[name] = t + scenario.wake_s
            else:
                name = f"gen-{len(load.engines)}"
                load.engines[name] = _Engine(name)
                load.cold_starts += 1
                ready_at[name] = t + scenario.cold_start_s
            load.engines[name].awake = True
            states[name] = "starting"
            last_up = t
        elif ratio < 0.5 and t - last_down >= 60.0 and len(active) > scenario.min_engines:
            name = min((e for e in active), key=lambda e: e.in_flight).name
            states[name] = "draining"
            drain_deadline[name] = t + scenario.drain_timeout_s
            last_down = t
    return load.result("verl")


def simulate_engines(scenario: EngineScenario) -> list[EngineSimResult]:
    """Both controllers over ``scenario``'s arrivals."""
    return [_run_verl(scenario), _run_deo(scenario)]


#: ``deo bench engines``'s one-line help.
HELP = "an engine pool in simulated time under verl's scheduler and under deo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the engine scenario's arguments on ``parser``."""
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--wake-s", type=float, default=5.0)
    parser.add_argument("--cold-start-s", type=float, default=180.0)


def run(args: argparse.Namespace) -> int:
    """Simulate the scenario ``args`` describe and print one line per controller (2: bad
    input)."""
    try:
        scenario = EngineScenario(
            duration_s=args.duration_s,
            seed=args.seed,
            wake_s=args.wake_s,
            cold_start_s=args.cold_start_s,
        )
    except ValueError as exc:
        print(f"deo bench engines: {exc}", file=sys.stderr)
        return 2
    print(f"engine scenario: {scenario}")
    for result in simulate_engines(scenario):
        shown = [
            f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
            for key, value in attrs.asdict(result).items()
        ]
        print("  " + ", ".join(shown))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.sim.engines", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
