"""The buffer policy's rule 5: removing workers from a queue above the band, and at the
off-policy limit, where production per worker cannot be measured."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.constants import (
    BOUND_SLACK,
    COLD_HALVING_STARTUP_S,
    FAR_NEEDS,
    FULL_SAMPLES_SHARE,
    HELD_FULL_SHARE,
    LIMIT_SAMPLES,
    LIMIT_SHARE,
    PINNED_SHARE,
    PINNED_STEPS,
    REFILL_MARGIN,
    REFILL_MAX_SHARE,
    REFILL_TAKES,
    REMOVAL_STARTUPS,
    REMOVAL_STEPS,
    STARTING_NEEDS,
)
from core.policies.buffer.memory import BufferMemory, settle_s
from core.policies.buffer.reading import Reading
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["remove"]


def remove(
    policy: BufferPolicy,
    context: PolicyContext,
    memory: BufferMemory,
    reading: Reading,
) -> Decision:
    """Rule 5: the queue is above the band. Whole workers and a fractional need would
    alternate between neighbouring counts, so a removal keeps the need plus the production
    spread, needs a whole worker more than that, and, unless the excess is clear (twice
    that), an excess lasting a window that spans the jitter. It never goes back to a count
    found short while demand has not fallen by more than a worker makes."""
    figures, batch, per_worker = reading.figures, reading.batch, reading.per_worker_seqs_s
    excess_since, interval_s = reading.excess_since_t, reading.interval_s
    t, current = context.t, policy.in_force(context)
    demand = memory.demand_seqs_s or 0.0
    queue = memory.queue_seqs
    startup = policy.startup(memory)
    step_s = batch / demand if demand > 0 else math.inf
    low_seqs = (policy.target(memory, batch) - policy.band_batches) * batch
    since_down = math.inf if memory.last_down_t is None else t - memory.last_down_t
    # A removal shows in the queue once the workers' last groups are in: a start-up (the
    # time to bring one back if it was wrong) before the next.
    cooldown = max(policy.down_cooldown_s, startup, min(4 * step_s, 2 * startup))
    floor = 0
    short = memory.short_workers
    # p measured over two start-ups of the present pool is trusted over its bound.
    measured = policy.per_worker(memory)
    # Demand estimates wander by a quarter when steps are short and uneven; a real fall
    # (a slower trainer) is more than that and more than a worker makes.
    fell = min(memory.short_demand_seqs_s - per_worker, 0.6 * memory.short_demand_seqs_s)
    if short is not None and demand > fell:
        # A worker above the count found short, and the need the demand that found it short
        # puts at p as measured: a demand estimate reading low by its jitter alone would
        # otherwise take the descent back below the need, and round again.
        floor = short + 1
        if measured:
            floor = max(floor, math.ceil(memory.short_demand_seqs_s / measured - 1e-9))
    settle = settle_s(step_s)
    at_limit = queue >= policy.offpolicy_seqs(batch) or (
        memory.limit_t is not None and t - memory.limit_t < settle
    )
    # (Not a measurement of intervals in which nothing could land: p then rests on its bound.)
    censored = policy.censored(memory, memory.per_worker_seqs_s) is not None
    fresh = memory.fresh_s >= 2 * startup and measured is not None and not censored
    if fresh and measured:
        per_worker = measured
    need = demand / per_worker
    pinned = memory.away_t is None or t - memory.away_t >= cooldown
    # Held at the limit for a cooldown by the workers up (seen away from it before, so not
    # a pool that came to this policy there): those still starting would make nothing the
    # trainer takes. (Not sooner: a worker's first groups all start together and the
    # fastest land first, so a queue that has just reached the limit proves little.) (Not
    # within a cooldown of a worker exiting early: those starting may be its replacements,
    # and their retries are what tells a crash loop.)
    held = memory.away_t is not None and t - memory.away_t >= cooldown
    pending = current - max(context.active, floor)
    assert context.queue is not None
    full_now = min(queue, context.queue.queued_sequences) >= policy.offpolicy_seqs(batch)
    failed = context.last_failure_t is not None and t - context.last_failure_t < cooldown
    if full_now and held and pending > 0 and not failed:
        return Decision(
            target=current - pending,
            reason=f"{figures}; queue at the off-policy limit with {context.active} "
            f"workers up -> {current - pending} (the {pending} not yet up are not needed)",
            memory=memory,
        )
    lowest = 1 if demand > 0 else 0  # never the last worker while the trainer takes batches
    refills = memory.refills_worker_s
    refilled = memory.refill_t is not None and (
        memory.last_down_t is None or memory.refill_t > memory.last_down_t
    )
    if at_limit and len(refills) >= REFILL_TAKES and refilled:
        # Each take restarts the envs at the limit, so each refill is the pool making a batch
        # from scratch: refilled within w worker-seconds of every take, REFILL_MARGIN x w /
        # step workers make REFILL_MARGIN x what the trainer takes. (The pool the last
        # removal left has refilled since.)
        slowest = max(refills)
        kept = math.ceil(REFILL_MARGIN * slowest / step_s - 1e-9)
        halved = current - math.floor(current * REFILL_MAX_SHARE)
        target = max(kept, halved, floor, lowest)
        if target < current:
            return Decision(
                target=target,
                reason=f"{figures}; queue at the off-policy limit, full again within "
                f"{slowest:.0f} worker-seconds of each of the last {len(refills)} takes: "
                f"{kept} {'worker makes' if kept == 1 else 'workers make'} twice what the "
                f"trainer takes -> stepping down to {target} (at most half the pool at a time)",
                memory=replace(memory, refill_kept_workers=kept),
            )
    if at_limit and not fresh:
        # The envs hold back at the off-policy limit, so p is not measured there and may
        # rest on its lower bound D / active (every estimate of the need reads high): step
        # down by a twentieth of the pool until the queue leaves the limit, never to a
        # count found short.
        share, how = LIMIT_SHARE, "a twentieth of the pool at a time"
        covered = step_s * PINNED_STEPS / startup if startup > 0 else PINNED_SHARE
        if not floor and pinned and covered > share:
            # Held at the limit for a whole cooldown, every worker makes at least D / n:
            # removing a share f leaves at most f x D short should the need lie just
            # below. The batches the full queue holds above the band cover that for
            # two steps / f, the start-up it takes to bring workers back when
            # f = 2 steps / start-up. At most a tenth (and max_down_fraction): with heavy
            # tails a pool held at the limit can fall short once the queue leaves it (the
            # off-policy stop discards the long groups, so a full queue overstates what
            # the pool makes).
            share = min(covered, PINNED_SHARE, policy.max_down_fraction)
            how = f"{share:.0%} of the pool, the queue held there for {cooldown:.0f}s at a time"
        step = max(1, math.floor(current * share))
        # Full at every sample for a cooldown while the trainer took batches: what each
        # take removed was made again within a sample interval i. A take from the full
        # queue removes every full batch (atroposlib's /batch), two or more at the limit,
        # so the pool makes at least 2 D s / i, and removing s / (i + s) of it still makes
        # D where s >= i. (With steps shorter than the samples that share rests on
        # measurement, not on the bound: over the regimes of bench/regimes.py, the share
        # the slowest refill the samples saw proves cost 1.7% more worker-hours and starved
        # no less.) (Not sooner than a cooldown: with heavy tails a pool held at the limit
        # refills from its shortest groups, and what it makes once the queue leaves the
        # limit shows only later.)
        full_s = 0.0 if memory.full_since_t is None else t - memory.full_since_t
        taken = context.queue.trainer_step - memory.full_since_step
        full = not floor and full_s >= cooldown and taken >= 2
        every_sample = full  # a proof of its own: the refills' count below does not hold it
        interval_s = interval_s if interval_s > 0 else step_s
        refill_share = min(policy.max_down_fraction, step_s / (interval_s + step_s))
        proven = 0.0
        off_bound = False  # (the share below, not the need on the bound, binds the step)
        if full:
            share = proven = refill_share
            step = max(1, math.floor(current * share))
            how = (
                f"{share:.0%} of the pool, the queue full at every sample for {full_s:.0f}s at "
                "a time"
            )
        elif not floor and pinned and memory.limit_samples >= LIMIT_SAMPLES:
            # Full at most samples: each take is made again within the share of a step the
            # samples found it short, so that share of the sample-interval bound holds.
            full_share = memory.full_samples / memory.limit_samples
            proven = full_share * refill_share
            found = f"the queue was full at {full_share:.0%} of the samples"
            if full_share >= FULL_SAMPLES_SHARE and proven > share and current * proven >= 1:
                # Full at most samples, the share proven covers the step: the pool's share,
                # up to what is proven (a tenth at most), not a worker off the need on the
                # bound D / active (the whole pool).
                full = True
                share = max(share, min(proven, PINNED_SHARE, policy.max_down_fraction))
                step = max(1, math.floor(current * share))
                what = "a worker at a time" if step == 1 else f"{share:.0%} of the pool"
                how = f"{what}: {found}"
            elif (
                full_share >= HELD_FULL_SHARE
                and covered > LIMIT_SHARE
                and startup >= COLD_HALVING_STARTUP_S
                and memory.last_down_t is not None
                and (memory.away_t is None or memory.away_t < memory.last_down_t)
            ):
                # Full at half the samples or more and at the limit ever since the last
                # removal: that removal did not take the queue off it, and the need on the
                # bound D / active (the whole pool) says nothing. With start-ups of a minute
                # or more a worker a cooldown would hold the excess for most of an hour:
                # twice the pinned share (a tenth at most).
                off_bound = True
                share = min(2 * covered, PINNED_SHARE, policy.max_down_fraction)
                step = max(1, math.floor(current * share))
                how = f"{share:.0%} of the pool: {found}, at the limit since the last removal"
            elif current * covered < 1 <= current * proven:
                how = f"a worker at a time: {found}"
        need_below = demand / measured if measured and demand > 0 else math.inf
        # p measured above its bound D / active was measured below the limit: a need, not the
        # whole pool. (A cold start's count may rest on a p read from its first groups.)
        active = context.active
        above_bound = (
            measured is not None and active > 0 and measured > BOUND_SLACK * demand / active
        )
        far = (memory.cold_workers > 0 or above_bound) and startup >= COLD_HALVING_STARTUP_S
        if far and not floor and pinned and current >= FAR_NEEDS * need_below:
            # Held at the limit, the pool is many times the need that p measured below it
            # puts: each worker makes D / n there and the need may lie far below, so half the
            # pool goes, down to twice that need (p read high, by a cold pool's first and
            # fastest groups, or before groups grew longer, still leaves a need's worth).
            full = True
            step = current - max(math.ceil(current / 2), math.ceil(2 * need_below - 1e-9))
            whose = "a cold start's " if memory.cold_workers > 0 else ""
            how = (
                f"half the pool, to twice the need: {whose}{current} workers, "
                f"{current / need_below:.1f} x the need p measured below the limit puts"
            )
        keep_need = 0
        if floor:
            # A count was found short, with p measured as the queue drained: down to the
            # need plus the spread, never below what was short.
            measured = measured or per_worker
            spread = policy.removal_margin_workers(memory, measured, startup, step_s)
            kept = math.ceil(demand / measured + spread - 1e-9)
            target = max(current - step, kept, floor, 0)
        else:
            # (Flaps keep more: the count this descent would stop at was undone before.)
            spread = policy.removal_margin_workers(memory, per_worker, startup, step_s)
            keep = need + policy.flaps(memory, t, need) * (1.0 + spread)
            kept_by_need = math.ceil(keep - 1e-9)
            balanced = kept_by_need if not (full or off_bound) else 0
            # Never below what the last removal on refills kept: the share rules step on the
            # bound D / active, which says nothing of a pool the refills sized (brought near
            # twice its need from scratch, it would descend a worker a cooldown below it).
            # A queue full at every sample proves its share without that bound.
            refill_kept = 0 if every_sample else memory.refill_kept_workers
            # Nor below the need that p measured above its bound D / active puts (each worker
            # left makes at least what it made), but with a queue full at every sample. On
            # its bound p says nothing: the need reads as the whole pool, and the descent
            # goes a worker (or the share the samples prove) below it.
            measured_above = per_worker > BOUND_SLACK * demand / max(context.active, 1)
            if measured_above and not every_sample:
                keep_need = kept_by_need
            target = max(min(balanced, current - 1), keep_need, current - step, lowest, refill_kept)
            if step > 1 and target == current - 1 and need >= current - 1e-9:
                # The share allowed more, but with p on its bound the need is the whole pool:
                # say what binds, not the share that did not.
                how = (
                    "a worker at a time: production per worker is not measured at the limit, "
                    "and its bound, demand over the workers, puts the need at the whole pool"
                )
        # A step rounds up to a whole worker, which may leave the trainer 1 / n of D short:
        # in a small pool with long start-ups more than the full queue covers for a
        # start-up (or the refills prove), and one removed in error starves the trainer
        # until its replacement is up.
        covers = full or floor or current * max(covered, proven) >= 1
        if target < current and since_down >= cooldown and covers:
            return Decision(
                target=target,
                reason=f"{figures}; queue at the off-policy limit -> stepping down to "
                f"{target} (at most {how})",
                memory=memory,
            )
        why = f", {short} were short" if floor >= current else ""
        if not floor and memory.refill_kept_workers >= current:
            why = f", {memory.refill_kept_workers} kept on the refills"
        elif not floor and keep_need >= current:
            why = f", the need at {per_worker:.2f} seq/s per worker keeps {keep_need}"
        if target < current and not covers:
            why = (
                f", a worker fewer could leave the trainer {1 / current:.0%} short, more than "
                f"the full queue covers for a {startup:.0f}s start-up"
            )
        return Decision(
            target=current,
            reason=f"{figures}; queue at the off-policy limit{why} -> hold {current}",
            memory=memory,
        )
    spread = policy.removal_margin_workers(memory, per_worker, startup, step_s)
    flaps = policy.flaps(memory, t, need)
    margin = (1.0 + spread) * (1.0 + flaps)
    damped = f", {flaps:.1f} removals undone" if flaps >= 0.05 else ""
    excess = current - need
    if excess < margin or floor >= current:
        # Fewer to spare than that: the queue rests higher (a little lag), where a removal
        # would bring the count back up.
        why = f"{short} were short" if floor >= current else f"a removal needs {margin:.2f}"
        why += damped
        return Decision(
            target=current,
            reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over ({why}) "
            f"-> hold {current}",
            memory=memory,
        )
    since = excess_since if excess_since is not None else t
    memory = replace(memory, excess_since_t=since)
    span = REMOVAL_STARTUPS * startup + REMOVAL_STEPS * min(step_s, startup)
    if excess < 2 * margin and t - since < span:
        return Decision(
            target=current,
            reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over for "
            f"{t - since:.0f}s of the {span:.0f}s a removal needs{damped} -> hold {current}",
            memory=memory,
        )
    # The need plus the spread, and the fewest workers that keep the queue inside the band
    # for a start-up (the time it takes to bring one back if this was wrong).
    kept = math.ceil(need + spread + flaps * (1.0 + spread) - 1e-9)
    horizon = startup + 4 * step_s
    safe = math.ceil((demand - (queue - low_seqs) / horizon) / per_worker - 1e-9)
    step = max(1, math.floor(current * policy.max_down_fraction))
    target = min(max(safe, kept, floor, current - step, 0), current)
    starting = ""
    if current > context.active:
        # Workers still starting make nothing yet: ``max_down_fraction``, the most a wrong
        # estimate may take from the trainer at once, does not hold them back. Those beyond
        # twice the need go (a cold pool's first groups may read p high by half).
        wanted = math.ceil(STARTING_NEEDS * need - 1e-9)
        spare = max(context.active, wanted, kept, floor, safe)
        if spare < target:
            target = spare
            going = current - target
            starting = f" (the {going} going are still starting; twice the need stays)"
    if target < current and since_down >= cooldown:
        return Decision(
            target=target,
            reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over (a removal needs "
            f"{margin:.2f}{damped}) -> stepping down to {target}{starting}",
            memory=replace(memory, excess_since_t=None),
        )
    return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)
