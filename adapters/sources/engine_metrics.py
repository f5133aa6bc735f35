"""An engine pool's load, read from each engine's Prometheus ``/metrics``.

Every ``interval_s`` the source reads ``GET /metrics`` of each engine it is given (deo run gives
the pool's ACTIVE and DRAINING engines: the ones with requests to count), all at once, each read
bounded by ``timeout_s``, and parses the text with prometheus-client's parser:

    vLLM:   vllm:num_requests_running + vllm:num_requests_waiting   (summed over the series:
    SGLang: sglang:num_running_reqs   + sglang:num_queue_reqs        one per data-parallel rank)

Each engine's requests (running plus waiting) become an :class:`~core.EngineLoadSampled`; where
the pool's router counts more requests in flight at an engine than the engine reports (sent, not
yet arrived), the larger count is taken, so a drain never ends early. Their sum over the pool is
one :class:`~core.LoadSampled`, which the ``threshold`` policy (verl's rule) divides by the active
engines' capacity.

An engine that cannot be read (refused, timed out, an error status, a metric missing) is never
counted as idle: the pool gets a :class:`~core.SourceDown` naming it and the core holds the
pool's count until every engine reads again. The engines that were read still report their own
load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio
import attrs
import httpx
from prometheus_client.parser import text_string_to_metric_families

from adapters.engine_endpoints import EngineEndpoint
from core import ConfigError, EngineLoadSampled, Event, LoadSampled, SourceDown

__all__ = [
    "METRIC_NAMES",
    "EngineLoad",
    "EngineMetricsSource",
    "parse_engine_load",
    "poll_engine_metrics",
    "sample_engine_metrics",
]

#: (running, waiting) gauge names per engine kind, as each engine exports them.
METRIC_NAMES: Mapping[str, tuple[str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}


@attrs.frozen(slots=True, kw_only=True)
class EngineLoad:
    """One engine's requests as its /metrics reports them."""

    running_requests: int
    waiting_requests: int


@attrs.frozen(slots=True, kw_only=True)
class EngineMetricsSource:
    """How to read one engine pool's load: the engines' kind, the period and the per-read limit."""

    pool: str
    engine: str
    interval_s: float = 2.0
    timeout_s: float = 2.0

    def __attrs_post_init__(self) -> None:
        where = f"pools.{self.pool}"
        if self.engine not in METRIC_NAMES:
            known = ", ".join(sorted(METRIC_NAMES))
            raise ConfigError(
                f"{where}.engine: no metric names known for {self.engine!r} ({known})"
            )
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ConfigError(f"{where}: the metrics interval_s and timeout_s must be > 0")


def parse_engine_load(engine: str, text: str) -> EngineLoad:
    """The running and waiting requests in an engine's /metrics text; ValueError naming what is
    missing or malformed."""
    running_name, waiting_name = METRIC_NAMES[engine]
    totals: dict[str, float] = {}
    # The parser yields families by their base name; samples keep the full one.
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (running_name, waiting_name):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    missing = [name for name in (running_name, waiting_name) if name not in totals]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} in /metrics")
    running, waiting = totals[running_name], totals[waiting_name]
    if not (running >= 0 and waiting >= 0):
        raise ValueError(f"negative or NaN request counts in /metrics: {running}, {waiting}")
    return EngineLoad(running_requests=round(running), waiting_requests=round(waiting))


async def _read(
    client: httpx.AsyncClient, source: EngineMetricsSource, endpoint: EngineEndpoint
) -> EngineLoad | str:
    url = endpoint.base_url.rstrip("/") + "/metrics"
    try:
        with anyio.fail_after(source.timeout_s):
            response = await client.get(url)
            response.raise_for_status()
            return parse_engine_load(source.engine, response.text)
    except TimeoutError:
        return f"{endpoint.worker_id} ({url}): no answer within {source.timeout_s:g} s"
    except Exception as exc:
        # A source never takes deo down: any failure is reported for the core to hold through.
        what = str(exc) or type(exc).__name__
        return f"{endpoint.worker_id} ({url}): {what}"


async def sample_engine_metrics(
    client: httpx.AsyncClient,
    source: EngineMetricsSource,
    engines: Sequence[EngineEndpoint],
    clock: Callable[[], float],
    router_in_flight: Mapping[str, int] | None = None,
) -> list[Event]:
    """One reading of every engine: an EngineLoadSampled per engine read, then the pool's
    LoadSampled, or a SourceDown naming the engines that could not be read."""
    readings: dict[str, EngineLoad | str] = {}

    async def read(endpoint: EngineEndpoint) -> None:
        readings[endpoint.worker_id] = await _read(client, source, endpoint)

    async with anyio.create_task_group() as tasks:
        for endpoint in engines:
            tasks.start_soon(read, endpoint)
    routed = router_in_flight or {}
    t = clock()
    events: list[Event] = []
    failures: list[str] = []
    total = 0
    for endpoint in engines:
        reading = readings[endpoint.worker_id]
        if isinstance(reading, str):
            failures.append(reading)
            continue
        reported = reading.running_requests + reading.waiting_requests
        in_flight = max(reported, routed.get(endpoint.worker_id, 0))
        total += in_flight
        events.append(
            EngineLoadSampled(
                t=t,
                pool=source.pool,
                worker_id=endpoint.worker_id,
                in_flight_requests=in_flight,
                waiting_requests=min(reading.waiting_requests, in_flight),
            )
        )
    if failures:
        error = f"{len(failures)} of {len(engines)} engine(s) unreadable: " + "; ".join(failures)
        events.append(SourceDown(t=t, pool=source.pool, error=error))
    else:
        events.append(LoadSampled(t=t, pool=source.pool, in_flight_requests=total))
    return events


async def poll_engine_metrics(
    source: EngineMetricsSource,
    engines: Callable[[], Sequence[EngineEndpoint]],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
    router_in_flight: Callable[[], Mapping[str, int]] | None = None,
) -> None:
    """Read the engines ``engines()`` lists every ``interval_s`` until cancelled."""
    async with httpx.AsyncClient(timeout=source.timeout_s) as client:
        while True:
            routed = router_in_flight() if router_in_flight is not None else None
            for event in await sample_engine_metrics(client, source, engines(), clock, routed):
                emit(event)
            await anyio.sleep(source.interval_s)
