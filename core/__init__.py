"""deo's core: a pure, deterministic reducer from events to commands.

Feed :class:`Reducer` events (each with its timestamp) and read the commands it returns; nothing
here performs I/O, reads a clock or draws a random number, so every runner, simulator and test
drives it the same way and a recorded log replays exactly.

    >>> from core import Reducer, Configured, Config, PoolSpec, PolicySpec
    >>> reducer = Reducer()
    >>> spec = PoolSpec(name="envs", argv=["python", "env.py"], min_workers=1, max_workers=4,
    ...                 policy=PolicySpec(name="static", params={"count": 2}))
    >>> [type(cmd).__name__ for cmd in reducer.step(Configured(t=0.0, config=Config(pools=[spec])))]
    ['ScalePool', 'SpawnWorker', 'SpawnWorker']
"""

from core.codec import decode, encode
from core.commands import (
    Command,
    CordonGpu,
    DrainWorker,
    KillWorker,
    RaiseAlert,
    ResolveAlert,
    ScalePool,
    SpawnWorker,
    TerminateWorker,
    UncordonGpu,
)
from core.config import Config, CordonRules, CrashLoopRules, PolicySpec, PoolSpec
from core.errors import (
    ConfigError,
    DeoError,
    IllegalTransition,
    InvalidEvent,
    InvariantViolation,
    Refused,
    UnknownSubject,
)
from core.events import (
    AutoscalingPaused,
    AutoscalingResumed,
    Configured,
    DrainRequested,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    EngineSleepFailed,
    EnginesWakeRequested,
    EngineWakeFailed,
    Event,
    GpuCordonRequested,
    GpuLost,
    GpuSampled,
    GpuUncordonRequested,
    LeftoverProcesses,
    LeftoverProcessesStopped,
    LoadSampled,
    PoolPinned,
    QueueSampled,
    SourceDown,
    SpawnFailed,
    Tick,
    WorkerAdopted,
    WorkerExited,
    WorkerHeartbeat,
    WorkerLost,
    WorkerReady,
    WorkersSeen,
    WorkerStarted,
)
from core.lifecycle import Trigger, WorkerState
from core.reducer import Reducer, reduce
from core.state import Gpu, PoolState, State, Worker

__all__ = [
    "AutoscalingPaused",
    "AutoscalingResumed",
    "Command",
    "Config",
    "ConfigError",
    "Configured",
    "CordonGpu",
    "CordonRules",
    "CrashLoopRules",
    "DeoError",
    "DrainRequested",
    "DrainWorker",
    "EngineAsleep",
    "EngineAwake",
    "EngineLoadSampled",
    "EngineSleepFailed",
    "EngineWakeFailed",
    "EnginesWakeRequested",
    "Event",
    "Gpu",
    "GpuCordonRequested",
    "GpuLost",
    "GpuSampled",
    "GpuUncordonRequested",
    "IllegalTransition",
    "InvalidEvent",
    "InvariantViolation",
    "KillWorker",
    "LeftoverProcesses",
    "LeftoverProcessesStopped",
    "LoadSampled",
    "PolicySpec",
    "PoolPinned",
    "PoolSpec",
    "PoolState",
    "QueueSampled",
    "RaiseAlert",
    "Refused",
    "Reducer",
    "ResolveAlert",
    "ScalePool",
    "SourceDown",
    "SpawnFailed",
    "SpawnWorker",
    "State",
    "TerminateWorker",
    "Tick",
    "Trigger",
    "UncordonGpu",
    "UnknownSubject",
    "Worker",
    "WorkerAdopted",
    "WorkerExited",
    "WorkerHeartbeat",
    "WorkersSeen",
    "WorkerLost",
    "WorkerReady",
    "WorkerStarted",
    "WorkerState",
    "decode",
    "encode",
    "reduce",
]
