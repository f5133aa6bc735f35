"""``deo status``, ``deo stop`` and the operator's actions: clients of a running deo's HTTP API.

Each finds deo from ``--url``, or from ``--config`` (the file ``deo run`` was started with: its
``[api]`` table gives the address and the variable holding the operator token), or at
``http://127.0.0.1:8787``. Exit status: 0 done, 1 refused by deo (an unknown pool, a pin
outside the bounds ...), 2 deo not reached or the command itself wrong (no token, bad file).

The operator token comes from ``$DEO_TOKEN`` (or the variable ``--token-env`` or the file's
``api.token_env`` names) or, when that is unset, from the file ``deo run`` wrote beside its log
when it generated the token (:func:`operator_token_path`; the log is the one ``--log`` or the
``--config`` file names).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx

from core import ConfigError, DeoError

__all__ = [
    "ACTIONS",
    "Action",
    "act",
    "add_action_arguments",
    "add_target_arguments",
    "find_operator_token",
    "token_problem",
    "operator_token_path",
    "status",
    "stop",
]

DEFAULT_URL = "http://127.0.0.1:8787"
DEFAULT_TOKEN_ENV = "DEO_TOKEN"


class _Refused(DeoError):
    """The command cannot be sent: its message says why (exit status 2)."""


class _Answered(DeoError):
    """deo answered the request with a refusal (exit status 1)."""


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` / ``--url`` (which deo), ``--token-env`` and ``--log`` (where the operator
    token is)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--config",
        type=Path,
        help="the TOML file deo run was started with: its [api] table says where deo listens "
        "and which variable holds the operator token, its deo.log where the generated token is",
    )
    where.add_argument("--url", help=f"deo's API address (default {DEFAULT_URL})")
    parser.add_argument(
        "--token-env",
        help="environment variable holding the operator token (default: the file's "
        f"api.token_env with --config, else {DEFAULT_TOKEN_ENV})",
    )
    parser.add_argument(
        "--log",
        type=Path,
        help="the run's event log: when the token variable is unset, the token deo run "
        "generated is read from LOG.token (default with --config: the file's deo.log)",
    )


def operator_token_path(log_path: Path) -> Path:
    """Where ``deo run`` writes the operator token it generated (mode 0600): beside the log."""
    return log_path.with_name(log_path.name + ".token")


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be sent in an Authorization header (None: it can). It is never
    quoted: a token does not belong in an error message."""
    if all("!" <= ch <= "~" for ch in token):
        return None
    if token.strip() != token:
        return "ends or starts with whitespace (a line end read from a file?)"
    return "holds whitespace or a character outside printable ASCII"


def find_operator_token(token_env: str, log_path: Path | None = None) -> str | None:
    """The operator token: ``$token_env`` if set, else the token file of the log at
    ``log_path`` if there is one, else None."""
    token = os.environ.get(token_env)
    if token:
        return token
    if log_path is None:
        return None
    try:
        return operator_token_path(log_path).read_text().strip() or None
    except OSError:
        return None


def _connectable(host: str) -> str:
    # A server listening on every interface is reached on loopback.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


@attrs.frozen(slots=True)
class _Target:
    url: str
    token_env: str
    log: Path | None


def _target(args: argparse.Namespace) -> _Target:
    """Which deo, and where its operator token is."""
    token_env = DEFAULT_TOKEN_ENV
    url = args.url or DEFAULT_URL
    log_path: Path | None = args.log
    if args.config is not None:
        from adapters.runtime.config_file import load_api, load_log_path

        try:
            api = load_api(args.config)
            log_path = log_path or load_log_path(args.config)
        except ConfigError as exc:
            raise _Refused(f"{args.config}: {exc}") from None
        if api.port == 0:
            raise _Refused(
                f"{args.config}: api.port = 0 lets deo run pick a free port, so the file does not "
                f"say where it listens; give --url (deo run prints it: 'deo: API on ...')"
            )
        url = f"http://{_connectable(api.host)}:{api.port}"
        token_env = api.token_env
    return _Target(url.rstrip("/"), args.token_env or token_env, log_path)


def _sendable_token(target: _Target) -> str | None:
    """The operator token (None: there is none); :class:`_Refused` for one no HTTP client can
    send."""
    token = find_operator_token(target.token_env, target.log)
    problem = None if token is None else token_problem(token)
    if problem is not None:
        raise _Refused(f"the operator token (${target.token_env} or LOG.token) {problem}")
    return token


def _operator_token(target: _Target) -> str:
    token = _sendable_token(target)
    if not token:
        raise _Refused(
            f"set ${target.token_env} to the operator token, or give --log LOG (or --config) "
            f"when deo run generated it and wrote it to LOG.token"
        )
    return token


def _error_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, str) else response.text


def _get(url: str, headers: dict[str, str]) -> Any:
    response = httpx.get(url, headers=headers, timeout=5.0)
    response.raise_for_status()
    return response.json()


def _when(t: Any) -> str:
    """A time as deo shows it: deo run's clock is wall time; a simulated one starts at 0."""
    if not isinstance(t, int | float):
        return "t=?"
    if t > 1e9:
        return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"
    return f"t={t:.1f}"


def _age(now: Any, t: Any) -> str:
    """How long before ``now`` the time ``t`` was, for a person: ``7s``, ``3m05s``, ``2h10m``."""
    if not isinstance(now, int | float) or not isinstance(t, int | float):
        return "?"
    seconds = max(0, round(now - t))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def status(args: argparse.Namespace) -> int:
    """Print the pools, workers, GPUs and alerts of a running deo."""
    try:
        target = _target(args)
        # The token, when there is one: a deo listening beyond loopback wants it for reads too.
        token = _sendable_token(target)
    except _Refused as exc:
        print(f"deo status: {exc}", file=sys.stderr)
        return 2
    url = target.url
    try:
        body = _get(f"{url}/global-status", {"Authorization": f"Bearer {token}"} if token else {})
        if not isinstance(body, dict):
            raise ValueError("the answer is not a JSON object")
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        print(f"deo status: {url}: {exc} (is deo running there?)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    now = body.get("now")
    print(_when(now) + ("  (autoscaling paused)" if body.get("paused_all") else ""))
    print(f"{'pool':<14}{'target':>7}{'workers':>9}  by state")
    for name, pool in sorted(body.get("pools", {}).items()):
        for line in pool_lines(name, pool, now):
            print(line)
    for gpu in body.get("gpus", []):
        causes = ", ".join(gpu.get("causes", [])) or "ok"
        print(f"GPU {gpu.get('id')}: {causes}")
    arbiter = body.get("arbiter")
    if isinstance(arbiter, dict):
        for line in arbiter_lines(arbiter):
            print(line)
    for alert in body.get("alerts", []):
        print(f"ALERT {alert.get('alert')} {alert.get('subject')}")
    return 0


def pool_lines(name: str, pool: dict[str, Any], now: Any) -> list[str]:
    """One pool's rows of ``deo status``: target and workers, pressure, drain deadline, a
    removal the stabilization window holds, the latest decisions."""
    lines: list[str] = []
    states = pool.get("workers_by_state", {})
    counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()) if n)
    lines.append(f"{name:<14}{pool.get('target', '?'):>7}{sum(states.values()):>9}  {counts}")
    queue = pool.get("queue")
    if isinstance(queue, dict):
        lines.append(
            f"{'':<14}queue {queue.get('queued_batches', 0):.2f} batches of "
            f"{queue.get('batch_size_seqs')} sequences, "
            f"trainer step {queue.get('trainer_step')} ({_age(now, queue.get('t'))} old)"
        )
    load = pool.get("load")
    if isinstance(load, dict):
        lines.append(
            f"{'':<14}{load.get('in_flight_requests')} requests in flight "
            f"({_age(now, load.get('t'))} old)"
        )
    deadline = pool.get("drain_deadline")
    if isinstance(deadline, dict):
        lines.append(f"{'':<14}drain deadline {deadline.get('seconds'):g}s: {deadline.get('why')}")
    if pool.get("source_error"):
        last = pool.get("last_sample_t")
        since = "no sample yet" if last is None else f"last sample {_age(now, last)} ago"
        lines.append(f"{'':<14}pressure source down ({since}): {pool['source_error']}")
    held = pool.get("held")
    if isinstance(held, dict):
        lines.append(
            f"{'':<14}stabilization window holds a removal to {held.get('target')} until "
            f"{_when(held.get('until_t'))}: {held.get('reason')}"
        )
    for decision in pool.get("decisions", [])[-3:]:
        what = f"{decision.get('type')}: {decision.get('reason')}"
        lines.append(f"{'':<14}{_when(decision.get('t'))} {what}")
    return lines


def arbiter_lines(arbiter: dict[str, Any]) -> list[str]:
    """The GPU arbiter's rows of ``deo status``: each pipeline's clusters with their priority,
    the GPUs they hold (training) or have awake (generation) against the generation target,
    and each waiting request with how long it has waited."""
    gpus = arbiter.get("gpus", [])
    lines = [
        f"arbiter: {len(gpus)} GPUs, {len(arbiter.get('idle', []))} idle"
        + (f", lost {', '.join(arbiter['lost'])}" if arbiter.get("lost") else "")
    ]
    lines.append(f"{'pipeline':<14}{'cluster':<12}{'priority':<16}{'GPUs':<18}waiting")
    for name, pipeline in sorted(arbiter.get("pipelines", {}).items()):
        for cluster_name, cluster in pipeline.get("clusters", {}).items():
            if "active_gpus" in cluster:
                share = cluster.get("share") or {}
                on = ",".join(cluster["active_gpus"]) or "-"
                gpus_text = f"{on} ({len(cluster['active_gpus'])}/{share.get('target_gpus', 0)})"
            else:
                gpus_text = ",".join(cluster.get("held", [])) or "-"
            waiting = cluster.get("waiting")
            wait_text = (
                f"{waiting.get('priority')} for {round(waiting.get('waited_s', 0))}s"
                if isinstance(waiting, dict)
                else ""
            )
            lines.append(
                f"{name:<14}{cluster_name:<12}{cluster.get('kind', '?'):<16}{gpus_text:<18}"
                f"{wait_text}"
            )
            engines = cluster.get("engines")
            if isinstance(engines, dict) and engines:
                states = ", ".join(
                    f"rank {rank} {e.get('worker')} {e.get('state')}"
                    for rank, e in sorted(engines.items(), key=lambda item: int(item[0]))
                )
                lines.append(f"{'':<14}engines ({cluster.get('engine_pool')}): {states}")
        if pipeline.get("rollout_open"):
            lines.append(f"{name:<14}rollout open")
    return lines


def _post(args: argparse.Namespace, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` to ``path`` with the operator token: the answer's JSON, or _Refused (not
    reached) / _Answered (refused by deo)."""
    target = _target(args)
    url = target.url
    token = _operator_token(target)
    try:
        response = httpx.post(
            f"{url}{path}",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30.0,
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _Refused(f"{url}: {exc} (is deo running there?)") from None
    if response.status_code != 200:
        raise _Answered(f"refused ({response.status_code}): {_error_of(response)}")
    return response.json()


def stop(args: argparse.Namespace) -> int:
    """Ask a running deo to stop, draining its workers first with ``--drain``."""
    try:
        _post(args, "/v1/stop", {"drain": bool(args.drain)})
    except _Refused as exc:
        print(f"deo stop: {exc}", file=sys.stderr)
        return 2
    except _Answered as exc:
        print(f"deo stop: {exc}", file=sys.stderr)
        return 1
    print("deo stop: " + ("draining every worker, then stopping" if args.drain else "stopping"))
    return 0


def _segment(value: str) -> str:
    return urllib.parse.quote(value, safe="")


@attrs.frozen(slots=True, kw_only=True)
class Action:
    """One operator action: its verb's help, its arguments, the request it sends."""

    help: str
    #: (name, help) of each positional argument; a name ending in "?" is optional.
    arguments: tuple[tuple[str, str], ...]
    #: The request path and JSON body for the parsed arguments.
    request: Callable[[argparse.Namespace], tuple[str, dict[str, Any]]]
    #: What was asked, for the line printed once deo accepted it.
    done: Callable[[argparse.Namespace], str]
    #: The command the action exists to bring about, and what to print when deo's answer
    #: holds none (the thing was already so): an operator is not told of a change not made.
    effect: str | None = None
    already: Callable[[argparse.Namespace], str] | None = None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of workers, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of workers >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _scope(pool: str | None) -> str:
    return f"pool {pool}" if pool else "every pool"


#: The operator's verbs: ``deo pause [POOL]``, ``deo pin POOL COUNT`` ...
ACTIONS: dict[str, Action] = {
    "pause": Action(
        help="stop autoscaling one pool (or every pool): its worker count holds",
        arguments=(("pool?", "the pool (default: every pool)"),),
        request=lambda a: ("/v1/pause", {"pool": a.pool}),
        done=lambda a: f"autoscaling paused for {_scope(a.pool)}",
    ),
    "resume": Action(
        help="resume autoscaling one pool (or every pool)",
        arguments=(("pool?", "the pool (default: every pool)"),),
        request=lambda a: ("/v1/resume", {"pool": a.pool}),
        done=lambda a: f"autoscaling resumed for {_scope(a.pool)}",
    ),
    "pin": Action(
        help="hold a pool at COUNT workers (within its bounds) whatever its policy says",
        arguments=(("pool", "the pool"), ("count", "the number of workers")),
        request=lambda a: (f"/v1/pools/{_segment(a.pool)}/pin", {"count": a.count}),
        done=lambda a: f"pool {a.pool} pinned at {a.count} worker(s)",
    ),
    "unpin": Action(
        help="hand a pinned pool back to its policy",
        arguments=(("pool", "the pool"),),
        request=lambda a: (f"/v1/pools/{_segment(a.pool)}/pin", {"count": None}),
        done=lambda a: f"pool {a.pool} unpinned",
    ),
    "wake": Action(
        help="wake every engine of an engine pool (before a validation pass, say) and hold them "
        "awake for HOLD_S seconds, or until `deo resume POOL`",
        arguments=(
            ("pool", "the engine pool"),
            ("hold_s?", "seconds to hold (default: until resumed)"),
        ),
        request=lambda a: (f"/v1/pools/{_segment(a.pool)}/wake", {"hold_s": a.hold_s}),
        done=lambda a: (
            f"waking every engine of {a.pool}, held "
            + (f"for {a.hold_s:g}s" if a.hold_s is not None else f"until `deo resume {a.pool}`")
        ),
    ),
    "drain": Action(
        help="drain one worker (it finishes its work and exits; its pool may replace it); an "
        "engine takes no new requests and stops once none is in flight",
        arguments=(("worker", "the worker id, e.g. envs-3"),),
        request=lambda a: (f"/v1/workers/{_segment(a.worker)}/drain", {}),
        done=lambda a: f"draining worker {a.worker}",
    ),
    "cordon": Action(
        help="place no new worker on a GPU (workers on it keep running)",
        arguments=(("gpu", "the GPU id as configured"),),
        request=lambda a: (f"/v1/gpus/{_segment(a.gpu)}/cordon", {}),
        done=lambda a: f"GPU {a.gpu} cordoned",
        effect="CordonGpu",
        already=lambda a: f"GPU {a.gpu} was already cordoned by an operator: nothing changed",
    ),
    "uncordon": Action(
        help="lift an operator's or a hardware cordon from a GPU",
        arguments=(("gpu", "the GPU id as configured"),),
        request=lambda a: (f"/v1/gpus/{_segment(a.gpu)}/uncordon", {}),
        done=lambda a: f"GPU {a.gpu} uncordoned",
        effect="UncordonGpu",
        already=lambda a: f"GPU {a.gpu} was not cordoned: nothing changed",
    ),
}


def add_action_arguments(parser: argparse.ArgumentParser, action: Action) -> None:
    """The positional arguments of ``action`` and the target options."""
    for name, text in action.arguments:
        optional = name.endswith("?")
        name = name.rstrip("?")
        parser.add_argument(
            name,
            nargs="?" if optional else None,
            type=_count if name == "count" else _seconds if name.endswith("_s") else str,
            help=text,
        )
    add_target_arguments(parser)


def act(verb: str, args: argparse.Namespace) -> int:
    """Send the operator action ``verb`` and print what deo did about it."""
    action = ACTIONS[verb]
    path, body = action.request(args)
    try:
        answer = _post(args, path, body)
    except _Refused as exc:
        print(f"deo {verb}: {exc}", file=sys.stderr)
        return 2
    except _Answered as exc:
        print(f"deo {verb}: {exc}", file=sys.stderr)
        return 1
    commands = answer.get("commands", []) if isinstance(answer, dict) else []
    types = {command.get("type") for command in commands}
    if action.effect is not None and action.already is not None and action.effect not in types:
        print(f"deo {verb}: {action.already(args)}")
    else:
        print(f"deo {verb}: {action.done(args)}")
    for command in commands:
        print(f"  {command.get('type')}: {command.get('reason')}")
    return 0
