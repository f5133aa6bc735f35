"""A training loop's client of deo's GPU arbiter (docs/arbiter.md), synchronous, over httpx.

::

    from deo_worker.arbiter_client import ArbiterClient, Cluster

    operator = ArbiterClient("http://127.0.0.1:8787", operator_token, pipeline="p1")
    p1_token = operator.register([
        Cluster("train", "ACTOR_TRAINING", ["0", "1"]),
        Cluster("gen", "GENERATION", ["0", "1", "2", "3"], tp_size=1),
    ])
    arbiter = ArbiterClient("http://127.0.0.1:8787", p1_token, pipeline="p1")
    arbiter.open_rollout()
    gen = arbiter.request("gen", "GENERATION")          # blocks until a rank is awake
    ... generate, arbiter.progress("rollout", target, done) now and then ...
    train = arbiter.release_and_request("gen", "train", "ACTOR_TRAINING")
    ... train on train.gpus ...
    arbiter.release("train")

:meth:`ArbiterClient.request` waits as long as it takes (or ``deadline_s``): each call to deo is
a long poll of ``poll_s`` seconds; a 408 means the request is still queued, and asking again
keeps its place. While deo cannot be reached (restarting) it retries; the request is in deo's
log, so a restarted deo still has it queued. Every poll of one request names it (a random
``request_id``), so a poll sent again after a release withdrew the request is refused
(:class:`ArbiterError`, 409) rather than queuing the request anew. A refusal (an unknown
pipeline, a bad priority, a request that failed because its GPUs are lost) raises
:class:`ArbiterError` with deo's message.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

__all__ = ["ArbiterClient", "ArbiterError", "ArbiterTimeout", "Cluster", "Grant"]

#: Where the client finds deo and its token when not given them: the pipeline's own token
#: (answered by :meth:`ArbiterClient.register`) if set, else the operator token.
API_URL_ENV = "DEO_API_URL"
PIPELINE_TOKEN_ENV = "DEO_PIPELINE_TOKEN"
TOKEN_ENV = "DEO_TOKEN"
#: One long poll; deo answers 408 at its end and the client asks again.
DEFAULT_POLL_S = 30.0
#: Pause between tries while deo cannot be reached or is stopping.
_RETRY_S = 0.5
_RETRY_STATUSES = frozenset({502, 503, 504})


class ArbiterError(Exception):
    """deo refused a call; ``status`` is its HTTP status, the message deo's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class ArbiterTimeout(ArbiterError):
    """:meth:`ArbiterClient.request` ran past its deadline; the request is still queued."""


@attrs.frozen(slots=True, kw_only=False)
class Cluster:
    """One cluster of a pipeline, as registered: ``kind`` is a priority name (its kind)."""

    name: str
    kind: str
    device_mapping: Sequence[str]
    tp_size: int = 1
    max_dp_size: int | None = None
    #: A generation cluster whose engines deo runs: the name of its engine pool.
    engine_pool: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "device_mapping": list(self.device_mapping),
            "tp_size": self.tp_size,
            "max_dp_size": self.max_dp_size,
            "engine_pool": self.engine_pool,
        }


@attrs.frozen(slots=True, kw_only=True)
class Grant:
    """A request answered: the GPUs the cluster holds (or, for generation, has awake)."""

    cluster: str
    gpus: tuple[str, ...]
    ranks: tuple[int, ...] = ()


class ArbiterClient:
    """Calls deo's arbiter endpoints for one pipeline. ``url`` defaults to ``$DEO_API_URL``;
    ``token`` (the operator's, or the pipeline's own for every call but :meth:`register`) to
    ``$DEO_PIPELINE_TOKEN``, else ``$DEO_TOKEN``; taken from the environment with both set,
    :meth:`register` and :meth:`token` use ``$DEO_TOKEN`` (the operator's)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        pipeline: str,
        poll_s: float = DEFAULT_POLL_S,
        call_timeout_s: float = 10.0,
    ) -> None:
        url = url or os.environ.get(API_URL_ENV)
        operator_token = None if token else os.environ.get(TOKEN_ENV)
        token = token or os.environ.get(PIPELINE_TOKEN_ENV) or operator_token
        if not url or not token:
            raise ValueError(
                f"ArbiterClient needs deo's URL and a token (${API_URL_ENV}; "
                f"${PIPELINE_TOKEN_ENV} or ${TOKEN_ENV})"
            )
        self.pipeline = pipeline
        self.poll_s = poll_s
        self._base = f"{url.rstrip('/')}/v1/arbiter/pipelines"
        self._call_timeout_s = call_timeout_s
        self._http = httpx.Client(headers={"Authorization": f"Bearer {token}"})
        #: Registering and asking for the pipeline's token need the operator's.
        self._operator_auth = {"Authorization": f"Bearer {operator_token or token}"}
        #: A request's id per cluster, kept while it stays queued after an ArbiterTimeout:
        #: asking again waits in its place, so deo tells this request apart from a new one (a
        #: release that withdrew it meanwhile is then answered 409, not queued anew).
        self._queued_ids: dict[str, str] = {}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ArbiterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- calls -----------------------------------------------------------------------------------

    def register(self, clusters: Sequence[Cluster]) -> str:
        """Register this pipeline with its clusters (all or none), with the operator token;
        returns the pipeline's own token, which authorizes this pipeline's calls only (hand it
        to a training loop instead of the operator token).

        A call sent again after its answer was lost (deo stopped before answering) and then
        refused as already registered succeeded the first time, if deo has these clusters."""
        body = {"pipeline": self.pipeline, "clusters": [c.as_json() for c in clusters]}
        response, resent = self._post_once_more(self._base, body, self._operator_auth)
        if resent and response.status_code == 409 and self._registered_as(clusters):
            return self.token()
        return str(self._checked(response)["token"])

    def token(self) -> str:
        """This registered pipeline's own token (asked with the operator token)."""
        url = f"{self._base}/{self.pipeline}/token"
        return str(self._checked(self._post_once_more(url, {}, self._operator_auth)[0])["token"])

    def unregister(self) -> None:
        """Leave: everything the pipeline holds is freed.

        A call sent again after its answer was lost and then refused as an unknown pipeline
        succeeded the first time."""
        response, resent = self._post_once_more(f"{self._base}/{self.pipeline}/unregister", {})
        if resent and response.status_code == 404 and "unknown pipeline" in response.text:
            return
        self._checked(response)

    def request(
        self,
        cluster: str,
        priority: str,
        *,
        estimate_trajectories: int | None = None,
        deadline_s: float | None = None,
    ) -> Grant:
        """Ask for ``cluster``'s GPUs with ``priority`` and wait for the grant (a generation
        cluster: until at least one rank is awake). Raises :class:`ArbiterTimeout` past
        ``deadline_s`` (None: wait as long as it takes), the request left queued."""
        body = {"priority": priority, "estimate_trajectories": estimate_trajectories}
        url = f"{self._base}/{self.pipeline}/clusters/{cluster}/request"
        return self._long_poll(url, body, deadline_s, cluster)

    def release(self, cluster: str) -> None:
        """Give back what ``cluster`` holds (generation: its ranks go to sleep)."""
        self._queued_ids.pop(cluster, None)  # its queued request, if any, is withdrawn
        self._post(f"{self._base}/{self.pipeline}/clusters/{cluster}/release", {})

    def release_and_request(
        self,
        release_cluster: str,
        cluster: str,
        priority: str,
        *,
        estimate_trajectories: int | None = None,
        deadline_s: float | None = None,
    ) -> Grant:
        """Release ``release_cluster`` and request for ``cluster`` in one step, then wait for
        the grant as :meth:`request` does."""
        body = {
            "release_cluster": release_cluster,
            "cluster": cluster,
            "priority": priority,
            "estimate_trajectories": estimate_trajectories,
        }
        url = f"{self._base}/{self.pipeline}/release-and-request"
        self._queued_ids.pop(release_cluster, None)
        return self._long_poll(url, body, deadline_s, cluster)

    def progress(self, stream: str, target_trajectories: int, completed_trajectories: int) -> None:
        """Report progress on ``stream`` (the latest report wins)."""
        body = {
            "stream": stream,
            "target_trajectories": target_trajectories,
            "completed_trajectories": completed_trajectories,
        }
        self._post(f"{self._base}/{self.pipeline}/progress", body)

    def clear_progress(self, stream: str | None = None) -> None:
        """Forget the progress of ``stream`` (every stream when None)."""
        self._post(f"{self._base}/{self.pipeline}/progress/clear", {"stream": stream})

    def open_rollout(self) -> None:
        """The rollout begins: the pipeline wants generation until :meth:`close_rollout`."""
        self._post(f"{self._base}/{self.pipeline}/rollout/open", {})

    def close_rollout(self) -> None:
        self._post(f"{self._base}/{self.pipeline}/rollout/close", {})

    # --- plumbing --------------------------------------------------------------------------------

    def _long_poll(
        self, url: str, body: dict[str, Any], deadline_s: float | None, cluster: str
    ) -> Grant:
        end = None if deadline_s is None else time.monotonic() + deadline_s
        request_id = self._queued_ids.pop(cluster, None) or uuid.uuid4().hex
        body = {**body, "request_id": request_id}
        while True:
            left = self.poll_s if end is None else min(self.poll_s, end - time.monotonic())
            if left <= 0:
                self._queued_ids[cluster] = request_id
                raise ArbiterTimeout(408, f"no grant within {deadline_s} s; the request is queued")
            response = self._send(
                url, {**body, "timeout_s": left}, left + self._call_timeout_s, end
            )
            if response.status_code == 408:
                continue
            answer = self._checked(response)
            return Grant(
                cluster=answer["cluster"],
                gpus=tuple(answer["gpus"]),
                ranks=tuple(answer.get("ranks", ())),
            )

    def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._checked(self._post_once_more(url, body)[0])

    def _post_once_more(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[httpx.Response, bool]:
        """POST with retries; also whether a retry followed an attempt deo may have carried out
        (sent, its answer lost), so that a refusal may be that attempt's own effect."""
        end = time.monotonic() + self._call_timeout_s * 3
        sent: list[bool] = []
        response = self._send(url, body, self._call_timeout_s, end, sent, headers)
        return response, any(sent)

    def _registered_as(self, clusters: Sequence[Cluster]) -> bool:
        """Whether deo has this pipeline registered with exactly ``clusters``."""
        try:
            status = self._http.get(
                self._base.removesuffix("/pipelines"), timeout=self._call_timeout_s
            ).json()
            found = status["pipelines"][self.pipeline]["clusters"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False
        wanted = {c.name: c.as_json() for c in clusters}
        return set(found) == set(wanted) and all(
            found[name]["device_mapping"] == list(spec["device_mapping"])
            and found[name]["kind"] == str(spec["kind"]).upper()
            for name, spec in wanted.items()
        )

    def _send(
        self,
        url: str,
        body: dict[str, Any],
        timeout_s: float,
        end: float | None,
        sent: list[bool] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST, retrying while deo cannot be reached or is stopping, until ``end``. A failure
        after the request may have reached deo (not a refused connection) is noted in
        ``sent``."""
        while True:
            try:
                response = self._http.post(url, json=body, timeout=timeout_s, headers=headers)
            except httpx.TransportError as exc:
                if sent is not None and not isinstance(exc, httpx.ConnectError):
                    sent.append(True)
                if end is not None and time.monotonic() >= end:
                    raise ArbiterError(0, f"deo cannot be reached: {exc!r}") from None
            else:
                if response.status_code not in _RETRY_STATUSES:
                    return response
                if end is not None and time.monotonic() >= end:
                    return response
            time.sleep(_RETRY_S)

    @staticmethod
    def _checked(response: httpx.Response) -> dict[str, Any]:
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": response.text[:200]}
        if not response.is_success:
            raise ArbiterError(response.status_code, str(answer.get("error", answer)))
        if not isinstance(answer, dict):
            raise ArbiterError(response.status_code, f"unexpected answer {answer!r}")
        return answer
