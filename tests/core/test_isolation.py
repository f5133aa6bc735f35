"""Nothing is shared between reducers: no module-level mutable state in the core, state read-only.

Two reducers, in two threads, with two catalogs that give one policy name two meanings, each see
only their own workers and their own policy. A caller cannot edit a state's collections. And
the core's modules bind no mutable container (dict, list, set, memo) at module level: checked on
the source with ``ast`` (the checker is itself tested on the patterns it must catch) and on the
imported modules' values.
"""

from __future__ import annotations

import ast
import collections
import functools
import importlib
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
import pytest

from core import (
    Config,
    Configured,
    DrainRequested,
    DrainWorker,
    InvariantViolation,
    LoadSampled,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    Reducer,
    ScalePool,
    SpawnWorker,
    State,
    Worker,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
    reduce,
)
from core.invariants import state_violations
from core.policies import BUILT_INS, Decision, PolicyContext
from core.records import replace
from core.state import count_workers
from core.step import Step

CORE = Path(__file__).resolve().parents[2] / "core"


# --- two reducers, two threads -------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Follow:
    """Wants ``factor`` x the in-flight requests; remembers the (counted, active) it was shown."""

    reacts_to: ClassVar[type] = LoadSampled
    factor: int = 1

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def decide(self, context: PolicyContext, memory: Any) -> Decision:
        assert context.load is not None
        return Decision(
            target=self.factor * context.load.in_flight_requests,
            reason=f"{self.factor} x {context.load.in_flight_requests}",
            memory=(context.current, context.active),
        )


@attrs.frozen(slots=True, kw_only=True)
class FollowTwice(Follow):
    factor: int = 2


def drive(reducer: Reducer, loads: list[int], factor: int, failures: list[str]) -> None:
    """Feed ``loads`` as samples, starting spawned workers and ending drained ones; record every
    count or target that is not this reducer's own."""
    pids = iter(range(1000, 100_000))
    t = 1.0
    for step, load in enumerate(loads):
        t += 1.0
        shown = reducer.state.worker_counts.get("envs", (0, 0))
        commands = reducer.step(LoadSampled(t=t, pool="envs", in_flight_requests=load))
        memory = reducer.state.pools["envs"].policy_memory
        if memory != shown:
            failures.append(f"factor {factor}, step {step}: policy saw {memory}, own {shown}")
        wanted = min(max(factor * load, 0), 40)
        targets = [c.target for c in commands if isinstance(c, ScalePool)]
        if targets not in ([], [wanted]):
            failures.append(f"factor {factor}, step {step}: targets {targets}, wanted {wanted}")
        for command in commands:
            if isinstance(command, SpawnWorker):
                pid = next(pids)
                reducer.step(
                    WorkerStarted(t=t, worker_id=command.worker_id, pid=pid, start_time=pid)
                )
            elif isinstance(command, DrainWorker):
                reducer.step(WorkerExited(t=t, worker_id=command.worker_id, exit_code=0))
        counts = dict(reducer.state.worker_counts)
        if counts != count_workers(reducer.state.workers.values()):
            failures.append(f"factor {factor}, step {step}: counts {counts} are not a recount")


def configured_reducer(policy_class: type) -> Reducer:
    catalog = BUILT_INS.extended({"follow": policy_class})
    reducer = Reducer(policies=catalog, check_invariants=True)
    pool = PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        min_workers=0,
        max_workers=40,
        require_ready=False,
        stabilization_s=0.0,
        policy=PolicySpec(name="follow"),
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[pool])))
    return reducer


@pytest.fixture
def switch_often() -> Iterator[None]:
    # Threads switch every microsecond instead of every 5 ms, so the two reducers interleave
    # within single steps.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("switch_often")
def test_two_reducers_in_two_threads_see_only_their_own_counts_and_policies() -> None:
    # The same name, "follow", is a different class in each reducer's catalog.
    once, twice = configured_reducer(Follow), configured_reducer(FollowTwice)
    loads_once = [(k * 7) % 23 for k in range(300)]  # up to 22 workers
    loads_twice = [(k * 5) % 17 for k in range(300)]  # up to 32 workers
    failures: list[str] = []
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(lambda: drive(once, loads_once, 1, failures),)),
        threading.Thread(target=run, args=(lambda: drive(twice, loads_twice, 2, failures),)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a reducer thread did not finish within 120 s"
    assert not errors, errors
    assert not failures, failures[:5]
    # Each ended where its own last sample put it.
    assert once.state.counted("envs") == loads_once[-1]
    assert twice.state.counted("envs") == min(2 * loads_twice[-1], 40)


def test_the_free_reduce_and_a_reducer_agree_and_share_nothing() -> None:
    pool = PoolSpec(
        name="envs",
        argv=["x"],
        max_workers=8,
        policy=PolicySpec(name="static", params={"count": 3}),
    )
    event = Configured(t=0.0, config=Config(pools=[pool]))
    reducer = Reducer()
    commands = reducer.step(event)
    state, free_commands = reduce(State(), event)
    assert state == reducer.state and free_commands == commands
    assert state.workers is not reducer.state.workers  # each step makes its own collections
    assert state.worker_counts == reducer.state.worker_counts == {"envs": (3, 0)}


# --- worker counts kept by each step --------------------------------------------------------------


def test_counts_follow_every_worker_change_and_equal_a_recount() -> None:
    reducer = Reducer(check_invariants=True)  # checks the counts against a recount every step
    pool = PoolSpec(
        name="envs",
        argv=["x"],
        max_workers=4,
        require_ready=True,
        policy=PolicySpec(name="static", params={"count": 3}),
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[pool])))
    assert reducer.state.worker_counts == {"envs": (3, 0)}  # requested
    reducer.step(WorkerStarted(t=1.0, worker_id="envs-0", pid=100, start_time=1))
    reducer.step(WorkerReady(t=2.0, worker_id="envs-0"))
    assert reducer.state.worker_counts == {"envs": (3, 1)}  # one active
    reducer.step(DrainRequested(t=3.0, worker_id="envs-0"))
    # envs-0 draining (not counted), envs-3 requested in its place
    assert reducer.state.worker_counts == {"envs": (3, 0)}
    reducer.step(WorkerExited(t=4.0, worker_id="envs-0", exit_code=0))
    assert reducer.state.worker_counts == {"envs": (3, 0)}
    reducer.step(PoolPinned(t=5.0, pool="envs", count=0))
    assert reducer.state.worker_counts == {}  # all draining: the pool has no entry
    assert dict(reducer.state.worker_counts) == count_workers(reducer.state.workers.values())


def test_the_invariant_check_catches_counts_that_are_not_a_recount() -> None:
    state = started_state()
    assert state_violations(state) == []
    wrong = replace(state, worker_counts=MappingProxyType({"envs": (3, 1)}))
    assert any("differ from a recount" in v for v in state_violations(wrong))
    assert wrong == state  # derived: not compared, which is why the check must look


def test_a_worker_written_past_put_worker_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # A plausible wrong reducer: a step that writes the worker table without keeping the counts.
    def put_worker_without_counting(self: Step, worker: Worker) -> None:
        self._own("workers")[worker.worker_id] = worker

    monkeypatch.setattr(Step, "put_worker", put_worker_without_counting)
    reducer = Reducer(check_invariants=True)
    pool = PoolSpec(name="envs", argv=["x"], policy=PolicySpec(name="static", params={"count": 1}))
    with pytest.raises(InvariantViolation, match="differ from a recount"):
        reducer.step(Configured(t=0.0, config=Config(pools=[pool])))


# --- read-only state ------------------------------------------------------------------------------


def started_state() -> State:
    reducer = Reducer()
    pool = PoolSpec(
        name="envs",
        argv=["x"],
        max_workers=4,
        policy=PolicySpec(name="static", params={"count": 2}),
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[pool], gpus=["gpu-0"])))
    reducer.step(WorkerStarted(t=1.0, worker_id="envs-0", pid=100, start_time=1))
    return reducer.state


@pytest.mark.parametrize("name", ["pools", "workers", "gpus", "last_seen", "worker_counts"])
def test_a_caller_cannot_edit_a_states_collections(name: str) -> None:
    state = started_state()
    collection: Any = getattr(state, name)
    key, value = next(iter(collection.items()))
    with pytest.raises(TypeError):
        collection[key] = value
    with pytest.raises(TypeError):
        collection["new"] = value
    with pytest.raises(TypeError):
        del collection[key]
    for method in ("clear", "pop", "update", "setdefault", "popitem"):
        assert not hasattr(collection, method), method
    assert not state_violations(state)


def test_a_dict_given_to_the_state_stays_the_callers() -> None:
    state = started_state()
    workers = dict(state.workers)
    rebuilt = State(
        now=state.now,
        config=state.config,
        pools=dict(state.pools),
        workers=workers,
        gpus=dict(state.gpus),
        last_seen=dict(state.last_seen),
    )
    assert rebuilt == state and rebuilt.worker_counts == state.worker_counts
    workers.clear()  # the caller's dict, not the state's
    assert rebuilt.workers == state.workers and rebuilt.worker_counts == {"envs": (2, 1)}


# --- no module-level mutable state in core/ -------------------------------------------------------

_MUTABLE_CALLS = frozenset(
    {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque"}
)
_READ_ONLY_CALLS = frozenset({"MappingProxyType", "frozenset", "tuple"})
_MEMO_DECORATORS = frozenset({"lru_cache", "cache", "cached_property"})


def _called_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mutable(value: ast.expr) -> str | None:
    """Why the module-level ``value`` is a mutable container, or None if it is not one."""
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return "a dict"
    if isinstance(value, (ast.List, ast.ListComp)):
        return "a list"
    if isinstance(value, (ast.Set, ast.SetComp)):
        return "a set"
    if isinstance(value, ast.Tuple):
        return next((why for why in map(_mutable, value.elts) if why is not None), None)
    if isinstance(value, ast.Call):
        name = _called_name(value)
        if name in _MUTABLE_CALLS:
            return f"a {name}()"
        if name in _MEMO_DECORATORS:
            return f"a {name} memo"
    return None


def module_level_mutable_state(source: str) -> list[str]:
    """Module-level mutable containers, memo decorators and ``global`` rebinding in ``source``.

    A name is judged by its last module-level binding (``X = MappingProxyType(X)`` makes ``X``
    read-only); ``__all__`` is exempt.
    """
    tree = ast.parse(source)
    last: dict[str, tuple[int, ast.expr, ast.expr | None]] = {}
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    last[target.id] = (node.lineno, node.value, None)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if isinstance(node.target, ast.Name):
                last[node.target.id] = (node.lineno, node.value, node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                if _called_name(decorator) in _MEMO_DECORATORS:
                    found.append(f"line {node.lineno}: {node.name} is a module-level memo")
    for name, (line, value, annotation) in sorted(last.items()):
        if name == "__all__":
            continue
        why = _mutable(value)
        if why is None and annotation is not None and isinstance(value, ast.Call):
            # A call of our own (``_registry()``): its declared type says what it returns.
            declared = _called_name(
                annotation.value if isinstance(annotation, ast.Subscript) else annotation
            )
            if declared in _MUTABLE_CALLS or declared in {"Dict", "List", "Set"}:
                why = f"declared {declared}"
        if why is not None:
            found.append(f"line {line}: {name} is {why}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
    return found


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_the_checker_catches_each_kind_of_module_level_mutable_state() -> None:
    source = textwrap.dedent(
        """
        import functools
        from types import MappingProxyType
        _COPIERS: dict[tuple[type, tuple[str, ...]], object] = {}
        REGISTRY: dict[str, type] = _registry()
        _FIELDS = {cls: 1 for cls in REGISTRY}
        _counted_for: tuple[object, dict[str, int]] = (None, {})
        SEEN = set()
        ORDER = [1, 2]

        @functools.lru_cache(maxsize=256)
        def _build(key):
            return key

        def remember(value):
            global _counted_for
            _counted_for = value

        __all__ = ["REGISTRY"]
        TABLE = {1: 2}
        TABLE = MappingProxyType(TABLE)
        POLICIES = MappingProxyType({"a": 1})
        NAMES = frozenset({"a", "b"})
        PAIR = ("a", 1)
        PATTERN = re.compile("x")
        """
    )
    found = module_level_mutable_state(source)
    for flagged in (
        "_COPIERS is a dict",
        "REGISTRY is declared dict",
        "_FIELDS is a dict",
        "_counted_for is a dict",
        "SEEN is a set()",
        "ORDER is a list",
        "_build is a module-level memo",
        "global _counted_for",
    ):
        assert any(flagged in line for line in found), (flagged, found)
    for allowed in ("__all__", "TABLE", "POLICIES", "NAMES", "PAIR", "PATTERN"):
        assert not any(f" {allowed} " in line for line in found), (allowed, found)
    assert len(found) == 8, found


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(CORE.parent)))
def test_core_modules_bind_no_mutable_state_at_module_level(path: Path) -> None:
    assert module_level_mutable_state(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(CORE.parent)))
def test_core_modules_hold_no_mutable_container_once_imported(path: Path) -> None:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    mutable = (dict, list, set, bytearray, collections.deque)
    held = [
        name
        for name, value in vars(module).items()
        if name != "__all__"
        and not (name.startswith("__") and name.endswith("__"))
        and (
            isinstance(value, (*mutable, functools._lru_cache_wrapper))
            or (isinstance(value, tuple) and any(isinstance(v, mutable) for v in value))
        )
    ]
    assert held == [], f"{module.__name__} holds mutable module-level values: {held}"
