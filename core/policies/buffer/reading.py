"""What the buffer policy's rules read at one sample: the measured rates and the counts they
give, computed once (:meth:`~core.policies.buffer.policy.BufferPolicy.decide`) and handed to
each rule in turn."""

from __future__ import annotations

import attrs

__all__ = ["Reading"]


@attrs.frozen(slots=True, kw_only=True)
class Reading:
    """One sample as the rules see it (sequences, seconds, workers)."""

    #: The count in force (the last decision applied, or being applied).
    current: int
    #: The trainer's batch B, the latest sample's queue and the one before it.
    batch: int
    raw_seqs: int
    previous_raw_seqs: int
    #: The queue smoothed over two steps, Q, and the band: target and edges.
    queue_seqs: float
    target_seqs: float
    low_seqs: float
    high_seqs: float
    #: D, p as the rules use it (bounded at the off-policy limit), T and the step time B / D
    #: (infinite while the trainer takes nothing).
    demand_seqs_s: float
    per_worker_seqs_s: float
    startup_s: float
    step_s: float
    #: The PI's count, the feed-forward count ceil(D / p), and the count a saturated shared
    #: inference holds the pool to (None: none now).
    workers: int
    balanced: int
    cap: int | None
    #: The queue below the off-policy limit (p measurable there), and the last addition's
    #: workers just active (their first groups still in generation).
    measurable: bool
    warming: bool
    #: Since the last applied addition and removal (infinite: none yet), and since the last
    #: sample.
    since_up_s: float
    since_down_s: float
    interval_s: float
    #: Since when the pool has held more than its need plus the removal margin (None: not at
    #: the last sample); only the removal rule carries it on.
    excess_since_t: float | None
    #: The figures every reason starts with.
    figures: str
