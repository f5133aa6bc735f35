"""``deo status`` and ``deo stop``: clients of a running deo's HTTP API.

The operator token comes from ``$DEO_TOKEN`` (or the variable ``--token-env`` names) or, when
that is unset, from the file ``deo run`` wrote beside its log when it generated the token
(:func:`operator_token_path`; give the log with ``--log``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["find_operator_token", "operator_token_path", "status", "stop"]


def operator_token_path(log_path: Path) -> Path:
    """Where ``deo run`` writes the operator token it generated (mode 0600): beside the log."""
    return log_path.with_name(log_path.name + ".token")


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


def _bearer(args: argparse.Namespace) -> dict[str, str]:
    token = find_operator_token(getattr(args, "token_env", "DEO_TOKEN"), getattr(args, "log", None))
    return {"Authorization": f"Bearer {token}"} if token else {}


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


def status(args: argparse.Namespace) -> int:
    """Print the pools, workers, GPUs and alerts of the deo at ``args.url``."""
    try:
        # The token, when there is one: a deo listening beyond loopback wants it for reads too.
        body = _get(f"{args.url}/global-status", _bearer(args))
        if not isinstance(body, dict):
            raise ValueError("the answer is not a JSON object")
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        print(f"deo status: {args.url}: {exc} (is deo running there?)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(_when(body.get("now")) + ("  (autoscaling paused)" if body.get("paused_all") else ""))
    print(f"{'pool':<14}{'target':>7}{'workers':>9}  by state")
    for name, pool in sorted(body.get("pools", {}).items()):
        states = pool.get("workers_by_state", {})
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()) if n)
        print(f"{name:<14}{pool.get('target', '?'):>7}{sum(states.values()):>9}  {counts}")
        queue = pool.get("queue")
        if isinstance(queue, dict):
            print(
                f"{'':<14}queue {queue.get('queued_batches', 0):.2f} batches of "
                f"{queue.get('batch_size_seqs')} sequences, "
                f"trainer step {queue.get('trainer_step')}"
            )
        if pool.get("source_error"):
            print(f"{'':<14}pressure source down: {pool['source_error']}")
        for decision in pool.get("decisions", [])[-3:]:
            what = f"{decision.get('type')}: {decision.get('reason')}"
            print(f"{'':<14}{_when(decision.get('t'))} {what}")
    for gpu in body.get("gpus", []):
        causes = ", ".join(gpu.get("causes", [])) or "ok"
        print(f"GPU {gpu.get('id')}: {causes}")
    for alert in body.get("alerts", []):
        print(f"ALERT {alert.get('alert')} {alert.get('subject')}")
    return 0


def stop(args: argparse.Namespace) -> int:
    """Ask the deo at ``args.url`` to stop, draining its workers first with ``--drain``."""
    headers = _bearer(args)
    if not headers:
        print(
            f"deo stop: set ${args.token_env} to the operator token, or give --log LOG when "
            f"deo run wrote it to LOG.token",
            file=sys.stderr,
        )
        return 2
    try:
        response = httpx.post(
            f"{args.url}/v1/stop", json={"drain": bool(args.drain)}, headers=headers, timeout=10.0
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        print(f"deo stop: {args.url}: {exc}", file=sys.stderr)
        return 2
    if response.status_code != 200:
        print(f"deo stop: {response.status_code}: {response.text}", file=sys.stderr)
        return 2
    print("deo stop: " + ("draining every worker, then stopping" if args.drain else "stopping"))
    return 0
