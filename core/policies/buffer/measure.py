"""How the buffer policy measures what its rules need, from queue samples alone.

Everything the rules need is measured from the samples, so one set of defaults serves a trainer
stepping every 0.3 s and one stepping every minute, workers that start in 5 s and in 3 minutes:

* the step time s = B / D and the demand D (seq/s): batches taken x B between trainer advances,
  averaged over 30 steps (at most ``rate_window_s``); a quick estimate, the step time averaged
  over the last 3 steps (after a speed-up, 3 of the new ones), replaces it when 25% higher or
  lower (a trainer that changed speed). Between 10% and 25% off, the demand goes half-way to
  it, so a rise is judged against the demand before it began (a trainer going from 7-s to
  3.5-s steps, seen through the quick average, never read 25% above the demand chasing it).
  A span without an advance while a batch waited for more than four steps is a pause
  (evaluation, checkpoint, restart): demand is measured afresh after it, and nothing is
  removed until it has been;
* the queue Q, smoothed over two steps (the saw-tooth of batches taken is noise);
* per-worker production p (seq/s/worker): what entered the queue (its change plus what the
  trainer took) over the workers active throughout the interval, over ``production_window_s``,
  only below 0.8 x ``max_batches_offpolicy`` batches and a few steps after the queue was last
  there (envs hold back near atroposlib's limit and take a group latency to produce at full rate
  again), and a few steps after workers came (their first groups are all in generation; a cold
  pool's first reading too: the interval its workers came in reads their first groups landing
  together). p is measured over a quarter of that window too, and where that reads 10% lower
  with the same workers active throughout the window, it is used instead: production per
  worker that falls as responses grow longer reads high over the whole window, and the pool
  falls short (a fall that came with more workers may be a saturating inference service).
  For its first settle time of measurement p counts intervals soon after the queue was near
  the limit too (a queue that nears it every few steps would leave p unmeasured); they stand
  in until the first interval away from the limit, which starts p afresh, and count no more
  (averaged in, those of a cold start read p 11% low for the rest of an hour: the pool, back
  near the limit, never measured it again). At the
  limit a queue that stays full proves p >= D / active, which is used when higher; so does a
  queue held above the band's top that was near the limit within a settle time (there p is
  left to the intervals after each visit, when the groups the limit cancelled are still in
  generation, and reads low: a large pool read 0.73-0.79 seq/s per worker for half an hour
  while its 117-127 workers held the queue up there, which proves 1.0-1.1). A p far under
  what entered the queue per worker (0 where nothing landed in any interval it counted) is
  censored: the rules use what entered instead, and the first interval measured after it
  starts p afresh;
* the refills (:func:`time_refills`): how long the full queue takes to be full again after each
  take, in worker-seconds per batch; at the limit the envs start afresh at each take, so this
  is the pool making a batch from scratch, where p cannot be measured;
* the start-up time T: from the sample at which a worker was first counted to the one at which it
  was first active (``startup_prior_s`` until one has been seen, or the age of the oldest worker
  still starting when longer);
* how hungry the trainer was: the share of the samples over the last start-up that found less
  than half a batch queued;
* the spread of production over a start-up: how much what the pool makes per worker over one
  start-up-long span differs from the next (heavy-tailed group latencies make it large). With
  ``target_batches`` 0 (the default), the target is 1 batch plus ``spread_k`` spreads, so a
  steady load keeps a short queue (little lag) and a bursty one a deeper buffer, never past
  ``max_batches_offpolicy - 1`` (atroposlib discards older groups).

Saturation (:mod:`core.policies.buffer.saturation`) is judged on the production measured here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.policies.base import PolicyContext
from core.policies.buffer.constants import (
    FAST_STEPS,
    FULL_SLACK_BATCHES,
    PAUSE_STEPS,
    RECENT_WINDOW_SHARE,
    REFILL_TAKES,
    SAME_LOAD,
    STALL_WINDOW_S,
)
from core.policies.buffer.memory import BufferMemory, average, settle_s, sped_up_lately
from core.policies.buffer.saturation import probe_in
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["fold_spread", "measure", "time_refills", "watch_stalls"]


def measure(policy: BufferPolicy, context: PolicyContext, memory: BufferMemory) -> BufferMemory:
    """The memory with this sample's measurements folded in."""
    sample = context.queue
    assert sample is not None
    t, batch, queued = context.t, sample.batch_size_seqs, sample.queued_sequences
    dt = t - memory.last_t
    changes: dict[str, object] = {
        "last_t": max(t, memory.last_t),
        "last_queued_seqs": queued,
        "last_step": sample.trainer_step,
        "last_active": context.active,
    }
    # What the reducer applied of the last decision (not told: the count shows it).
    desired = context.current if context.desired is None else context.desired
    if desired is not None and memory.last_desired is not None:
        if desired > memory.last_desired:
            changes["last_up_t"] = memory.last_t
            changes["up_from_workers"] = memory.last_active
            changes["up_from_seqs_s"] = memory.fast_demand_seqs_s or 0.0
            if desired != memory.cold_workers:
                changes["cold_workers"] = 0  # grown on a measurement: no cold start's count
            down, up = memory.last_down_t, memory.last_up_t
            undone = down is not None and (up is None or down > up)
            need = policy.need(memory)
            if undone and need is not None and need <= SAME_LOAD * memory.down_need_workers:
                flaps = policy.flaps(memory, t, need) + 1.0
                changes.update(flaps=flaps, flaps_t=t, flap_need_workers=need)
        elif desired < memory.last_desired:
            changes["last_down_t"] = memory.last_t
            # A saturation test or a pause let go is undone on purpose: never a flap.
            deliberate = memory.shed_workers > 0 or memory.workers_before_pause is not None
            changes["down_need_workers"] = 0.0 if deliberate else policy.need(memory) or 0.0
    changes["last_desired"] = desired
    # Start-up: the oldest workers still starting are the ones that became active.
    pending = list(memory.pending_t)
    # Counted since the previous sample (requested then at the latest), before any is popped:
    # a worker may be requested and become active between two samples.
    counted_before = memory.last_active + len(pending)
    pending.extend([memory.last_t] * max(context.current - counted_before, 0))
    became = max(context.active - memory.last_active, 0)
    startup, seen = memory.startup_s, memory.startups_seen
    for _ in range(min(became, len(pending))):
        age = t - pending.pop(0)
        seen += 1
        startup = age if startup is None else startup + (age - startup) / min(seen, 8)
    starting = max(context.current - context.active, 0)
    del pending[starting:]  # cancelled or failed: the newest go first
    pending.extend([memory.last_t] * (starting - len(pending)))
    changes.update(pending_t=tuple(pending), startup_s=startup, startups_seen=seen)
    returning = memory.returning_workers
    if returning is not None and (context.active >= returning or context.current < returning):
        changes["returning_workers"] = None
    if context.active > memory.last_active:
        changes["active_changed_t"] = t
        # Workers added may make less each (a shared inference saturating); a removal
        # leaves each of the rest making at least what it made, so p stays the present
        # pool's (reset there, the next removal at the off-policy limit would rest on p's
        # bound and a twentieth of the pool a cooldown, however far the need lies below).
        # Workers coming back after a pause are the pool p was measured with.
        if returning is None or context.active > returning:
            changes["fresh_s"] = 0.0
    if dt <= 0:
        return replace(memory, **changes)
    step_s = policy.step_s(memory, batch)
    hungry = 1.0 if queued < 0.5 * batch else 0.0
    weight = 1.0 - math.exp(-dt / max(policy.startup(memory), dt))
    changes["hungry_share"] = memory.hungry_share + weight * (hungry - memory.hungry_share)
    queue_window = min(max(2 * (step_s or 0.0), dt), policy.rate_window_s / 2)
    changes["queue_seqs"] = average(
        memory.queue_seqs, queued, memory.queue_seen_s, dt, queue_window
    )
    changes["queue_seen_s"] = min(memory.queue_seen_s + dt, queue_window)
    steps = max(sample.trainer_step - memory.last_step, 0)
    consumed = steps * batch
    demand_window = policy.demand_window_s(step_s)
    if steps:
        changes["last_advance_t"] = t
    if steps and memory.last_advance_t is not None:
        # From one advance to the next: sampling at arbitrary phases of a step would add a
        # ripple of a whole batch per sample to the estimate.
        span = t - memory.last_advance_t
        # (Right after a pause, a second long span is a slower trainer.)
        paused = (
            step_s is not None
            and span > PAUSE_STEPS * step_s + dt
            and memory.last_queued_seqs >= batch
            and (memory.resumed_t is None or memory.demand_seen_s > 0)
        )
        if paused:
            # The trainer took nothing while a batch waited: a pause. What it takes now is
            # measured afresh (the demand before it may not hold after a restart).
            changes.update(resumed_t=t, demand_seen_s=0.0, fast_demand_seqs_s=None)
        else:
            rate = consumed / span
            demand = average(memory.demand_seqs_s, rate, memory.demand_seen_s, span, demand_window)
            # The quick estimate averages step times over steps, not rates over seconds:
            # after a speed-up three of the new steps move it (three seconds of the old
            # length would take twice as many), and one short span between two samples
            # moves it by a step's share, not by its rate (rates of short spans are large).
            step_now = span / steps
            fast_step = (
                step_now
                if memory.fast_demand_seqs_s is None or memory.demand_seen_s <= 0
                else batch / memory.fast_demand_seqs_s
            )
            fast_step += (1.0 - math.exp(-steps / FAST_STEPS)) * (step_now - fast_step)
            fast = batch / fast_step
            # (Against the demand before a rise began: the demand follows the quick rate.)
            rose_from = memory.rising_from_seqs_s
            base, before = demand, memory.demand_seqs_s or 0.0
            if rose_from is not None:
                base, before = min(base, rose_from), min(before, rose_from)
            # Measured afresh after a pause: a trainer back faster than it went is a
            # speed-up as any other (starving, the fresh average would soon read only what
            # the pool makes).
            after_pause = memory.demand_seen_s <= 0 and before > 0
            if after_pause:
                base = min(base, before)
            rising_from = None  # (set again below while the rise goes on)
            if fast > 1.25 * base or fast < 0.75 * demand:
                if fast > demand or (after_pause and fast > base):
                    # Sped up: the queue averaged over the slower steps is another trainer's.
                    # This sample stands for it until the next starts the average afresh.
                    changes.update(queue_seqs=float(queued), queue_seen_s=0.0)
                    if memory.last_queued_seqs >= batch:
                        # Read while a batch waited, the rise is the trainer's own (starving,
                        # its rate is what the pool makes, and rises with each worker added).
                        if not sped_up_lately(memory, t, policy.startup(memory)):
                            # (Its quick rate then: after a pause that is the trainer's
                            # own pace, which a starving trainer's quick rate soon forgets.)
                            changes.update(sped_up_from_seqs_s=before, sped_up_to_seqs_s=fast)
                        changes["sped_up_t"] = t
                demand = fast  # the trainer sped up or slowed down (not step-timing noise)
            elif not 0.9 * demand <= fast <= 1.1 * demand:
                if fast > demand and memory.demand_seen_s >= demand_window:
                    rising_from = base  # (a demand still being learned rises as it is)
                demand = (demand + fast) / 2  # and it is still settling
            changes["rising_from_seqs_s"] = rising_from
            changes["demand_seqs_s"] = demand
            changes["fast_demand_seqs_s"] = fast
            demand_seen = min(memory.demand_seen_s + span, demand_window)
            changes["demand_seen_s"] = demand_seen
            # Measured over the window rule 4 waits for: the pause is over. (Kept, it would hold
            # removals again whenever the step time rose, the window growing past what was
            # seen: minutes of a slower trainer long after the pause.)
            measured = demand > 0 and demand_seen >= policy.demand_window_s(batch / demand)
            if memory.resumed_t is not None and measured:
                changes["resumed_t"] = None
    produced = max(queued - memory.last_queued_seqs + consumed, 0)
    changes.update(watch_stalls(policy, memory, context, produced, consumed, step_s))
    if probe_in(memory, context.active, t, step_s):
        changes["probe_made_seqs"] = memory.probe_made_seqs + produced
        changes["probe_made_s"] = memory.probe_made_s + dt
    changes["production_seqs_s"] = average(
        memory.production_seqs_s, produced / dt, memory.production_seen_s, dt, demand_window
    )
    throughout = min(context.active, memory.last_active)
    # Workers that just started make less than they will (their first groups are all still
    # in generation): p is measured once the pool has settled. A few steps: p reads a
    # little low for a group latency after workers come, but it must keep up with a pool
    # that grows and shrinks.
    settle = settle_s(step_s)
    near_limit = max(queued, memory.last_queued_seqs) >= policy.offpolicy_seqs(batch)
    if near_limit:
        changes["limit_t"] = t
    elif memory.limit_t is None or t - memory.limit_t >= settle:
        changes["away_t"] = t
        if memory.limit_t is not None:
            changes["cold_workers"] = 0  # off the limit: the pool is near its need
    # Full: at the limit, not above it (groups that were in flight when it was reached
    # may land on top: a backlog above the limit stays full whatever the pool makes).
    limit_seqs = policy.max_batches_offpolicy * batch
    full_now = abs(queued - limit_seqs) <= FULL_SLACK_BATCHES * batch
    if full_now:
        if memory.full_since_t is None:
            changes.update(full_since_t=t, full_since_step=sample.trainer_step)
    else:
        changes["full_since_t"] = None
    changes.update(time_refills(policy, memory, context, steps))
    if "away_t" in changes or "last_down_t" in changes:
        changes.update(limit_samples=0, full_samples=0)
    else:
        changes.update(
            limit_samples=memory.limit_samples + 1,
            full_samples=memory.full_samples + int(full_now),
        )
    # Until p has been measured for a settle time it is provisional: once the pool has
    # settled, intervals soon after the queue was near the limit count too. Where the queue
    # reaches the limit every few steps (a trainer that fetches every full batch at once),
    # p would otherwise never be measured, or rest on the first interval (the one in which a
    # cold pool's workers came reads them as one while all of them post their first groups,
    # 40-90x high; the next may hold no group yet).
    provisional = (
        memory.production_seen_s < min(settle, policy.production_window_s)
        and not memory.restarted_away_p
    )
    settled = t - memory.active_changed_t >= settle and (
        provisional or memory.limit_t is None or t - memory.limit_t >= settle
    )
    if throughout > 0 and settled and not near_limit:
        # A p far under what entered the queue per worker was measured where nothing could
        # land (:meth:`BufferPolicy.censored`): averaged in, it would hold p down for a
        # window after the queue leaves the limit, and the pool at need / p far above it.
        seen_s = memory.production_seen_s
        if policy.censored(memory, memory.per_worker_seqs_s) is not None:
            seen_s = 0.0
        # Soon after the limit the groups it cancelled are still in generation, and p reads
        # low (a cold start hovering near it: 1.3 seq/s per worker where the envs make 2.7);
        # it stands in only until an interval away from the limit is measured. Averaged with
        # those, it would stay low for the whole window, and a pool back near the limit
        # would never measure it again.
        soon = memory.limit_t is not None and t - memory.limit_t < settle
        afresh = memory.near_limit_p and not soon
        if afresh:
            seen_s = 0.0
            changes.update(near_limit_p=False, restarted_away_p=True, production_seen_s=0.0)
        elif soon:
            changes["near_limit_p"] = True
        changes["per_worker_seqs_s"] = average(
            memory.per_worker_seqs_s,
            produced / dt / throughout,
            seen_s,
            dt,
            policy.production_window_s,
        )
        changes["recent_per_worker_seqs_s"] = average(
            memory.recent_per_worker_seqs_s or memory.per_worker_seqs_s,
            produced / dt / throughout,
            seen_s,
            dt,
            policy.production_window_s * RECENT_WINDOW_SHARE,
        )
        changes["production_seen_s"] = min(
            (0.0 if afresh else memory.production_seen_s) + dt, policy.production_window_s
        )
        if context.active == memory.last_active:
            changes["fresh_s"] = memory.fresh_s + dt
        if not provisional:
            p = changes["per_worker_seqs_s"]
            assert isinstance(p, float)
            changes["best_per_worker_seqs_s"] = max(memory.best_per_worker_seqs_s, p)
            fewest = memory.fewest_measured_workers
            changes["fewest_measured_workers"] = min(fewest, throughout) if fewest else throughout
        changes.update(fold_spread(policy, memory, t, produced, throughout * dt))
    return replace(memory, **changes)


def time_refills(
    policy: BufferPolicy, memory: BufferMemory, context: PolicyContext, steps: int
) -> dict[str, object]:
    """Time how long the full queue takes to be full again after each take. At the off-policy
    limit the envs cancel what they generate and start afresh at each take, so a refill is
    the present pool making a batch from scratch: the slowest of the recent ones bounds what
    it makes from below (a pool that refills in a tenth of a step makes ten times what the
    trainer takes) where the queue samples cannot measure production per worker. A refill is
    kept in worker-seconds per batch (its time x the workers active): a smaller pool refills
    in fewer (each batch needs a larger share of the groups it has in generation, and the
    share of the shortest ones the first batch takes grows more slowly than the pool
    shrinks), so the series carries over a removal and starts again when workers come; a
    take before the queue was full again ends it (the proof fails)."""
    assert context.queue is not None
    batch = context.queue.batch_size_seqs
    full_now = context.queue.queued_sequences >= policy.limit_reached_seqs(batch)
    # (Over an interval in which workers went, the count before: those that went may have
    # made part of it.)
    came = context.active > memory.last_active
    refills, workers = () if came else memory.refills_worker_s, memory.last_active
    pending, batches, timed = memory.refill_from_t, memory.refill_batches, None
    if pending is not None and full_now:
        timed = (context.t - pending) * workers / batches
        pending = None
    elif pending is not None and steps:
        refills, pending = (), None  # taken again before it was full: no proof
    # Taken from the full queue (not from a backlog above the limit, which a take may leave
    # full whatever the pool makes).
    if steps and memory.full_since_t is not None:
        if full_now:
            timed = (context.t - memory.last_t) * workers / steps
        else:
            pending, batches = memory.last_t, steps
    changes: dict[str, object] = {"refill_from_t": pending, "refill_batches": batches}
    if timed is not None and not came:
        refills = (*refills, timed)[-REFILL_TAKES:]
        changes["refill_t"] = context.t
    changes["refills_worker_s"] = refills
    if came:
        changes["refill_kept_workers"] = 0
    return changes


def watch_stalls(
    policy: BufferPolicy,
    memory: BufferMemory,
    context: PolicyContext,
    produced: int,
    consumed: int,
    step_s: float | None,
) -> dict[str, object]:
    """Count the trainer left waiting a step or more after the queue fell from the off-policy
    limit with less than a batch landing: the groups outlast the batches the queue held, and
    the envs stopped at the limit, so each visit there costs a wait however many workers run.
    A restart (the trainer's step going back) or a queue flushed ends the watch."""
    assert context.queue is not None
    t, queued, batch = context.t, context.queue.queued_sequences, context.queue.batch_size_seqs
    step = context.queue.trainer_step
    stalls = tuple(s for s in memory.stall_times if t - s < STALL_WINDOW_S)
    changes: dict[str, object] = {"stall_times": stalls}
    if not stalls:
        changes.update(stall_shed_workers=0, stall_floor_workers=0)
    unfed = {"unfed_limit_t": None, "unfed_below_t": None, "unfed_made_seqs": 0}
    restarted = step < memory.last_step
    if restarted:
        changes["restarted_t"] = t
    watched = memory.unfed_limit_t
    counted = watched is not None and bool(stalls) and stalls[-1] >= watched  # this visit's
    made = memory.unfed_made_seqs + produced  # landed since the visit to the limit
    landed = made >= batch
    # At the limit: within the slack of a full queue, where the envs stop.
    at_limit = queued >= policy.limit_reached_seqs(batch)
    # From the limit on the trainer could have stepped back to back: the time it did not
    # step is time it waited, less up to a step (it may have been within one at the limit).
    # Samples further apart than the wait (a batch landing within the sample interval) see
    # it only so. Only within a settle time of the limit: a longer span (samples missed for
    # minutes) says nothing of what the trainer did in it.
    idle_s = 0.0
    if watched is not None and step_s and t - watched <= settle_s(step_s):
        idle_s = t - watched - (step - memory.unfed_limit_step) * step_s - step_s
    if counted and (at_limit or landed):
        # A stalled visit ends: it waited from the queue falling below a batch, or as long
        # as it did not step.
        below_s = 0.0 if memory.unfed_below_t is None else t - memory.unfed_below_t
        if max(below_s, idle_s) > 0:  # (else the wait measured when it was counted stands)
            changes["stall_wait_s"] = max(below_s, idle_s)
    if at_limit:
        changes.update(unfed, unfed_limit_t=t, unfed_limit_step=step)
        return changes
    if watched is None:
        return changes
    if restarted or queued < memory.last_queued_seqs - consumed or context.active == 0:
        changes.update(unfed, restarted_t=t)  # a restart or a flushed queue, not the trainer
        return changes
    # A pool that landed about what it makes since the visit (at its measured production) was
    # making: the trainer waits on a short pool, not on groups the limit cancelled.
    making = context.active * (memory.per_worker_seqs_s or 0.0) * (t - watched)
    short = made >= making / 2 > 0
    if step_s is not None and idle_s >= step_s and not counted and not short:
        changes["stall_times"] = (*stalls, t)
        changes["stall_wait_s"] = idle_s
        counted = True
    if landed:
        changes.update(unfed)  # a batch landed: the envs are making again
        return changes
    changes["unfed_made_seqs"] = made
    if queued < batch:
        below = t if memory.unfed_below_t is None else memory.unfed_below_t
        changes["unfed_below_t"] = below
        if step_s is not None and t - below >= step_s and not counted and not short:
            # Not before the trainer could have stepped through what it took since the visit:
            # atroposlib's /batch hands it every full batch at once, the queue falls under
            # one, and it trains on them meanwhile.
            held = t - watched < (step - memory.unfed_limit_step) * step_s
            if not held:
                changes["stall_times"] = (*stalls, t)
    return changes


def fold_spread(
    policy: BufferPolicy, memory: BufferMemory, t: float, produced: float, worker_s: float
) -> dict[str, object]:
    """Fold one interval into the start-up-long spans: the spread is how much the production
    of the pool over a start-up changes from one span to the next (slow drifts cancel)."""
    if memory.spread_since_t is None:
        return {"spread_sum_seqs": 0.0, "spread_worker_s": 0.0, "spread_since_t": t}
    total, worker_total = memory.spread_sum_seqs + produced, memory.spread_worker_s + worker_s
    span = t - memory.spread_since_t
    if span < policy.startup(memory) or worker_total <= 0:
        return {"spread_sum_seqs": total, "spread_worker_s": worker_total}
    rate = total / worker_total
    changes: dict[str, object] = {
        "spread_sum_seqs": 0.0,
        "spread_worker_s": 0.0,
        "spread_since_t": t,
        "spread_rate_seqs_s": rate,
    }
    if memory.spread_rate_seqs_s is not None:
        # The pool's production over the span, had it kept this span's workers.
        square = ((rate - memory.spread_rate_seqs_s) * worker_total) ** 2 / 2
        seen = memory.spreads_seen + 1
        var = memory.spread_var_seqs2
        var = square if var is None else var + (square - var) / min(seen, 10)
        changes.update(spread_var_seqs2=var, spreads_seen=seen)
    return changes
