"""``buffer``: the default for trainer queues. Hold the queue within target +- band batches.

Units are sequences throughout: a queue sample carries queued sequences (Atropos: queued groups x
group size) and the trainer's batch size B in sequences.

Why a band. The trainer starves when a step ends with less than a batch queued, and every batch
queued ahead of a sequence is a step of off-policy lag. With whole workers, production rarely
equals demand, so the count alternates between neighbours and the queue drifts between the edges
of ``target +- band_batches``; the rules below keep those alternations minutes apart.

Below, D is the demand (seq/s), p the production per worker, T the start-up, Q the queue
smoothed over two steps and s the trainer's step time, all measured (:mod:`.measure`).

The package: :mod:`.measure` (what the rules need, from the samples), :mod:`.policy` (the
parameters, rule 1, and the rules tried in order on a :mod:`.reading` of the sample),
:mod:`.growth` (rule 2), :mod:`.addition` (rule 3), :mod:`.pause` (rule 4), :mod:`.removal`
(rule 5), :mod:`.saturation` (the search for the count a shared inference saturates at),
:mod:`.stalls` (the steps down on ``offpolicy_stalls``), :mod:`.memory` (what carries from one
sample to the next), :mod:`.constants` (its fixed numbers).

The count the policy works from is the one the reducer applied: ``PolicyContext.desired``
tells, on the next call, whether the last decision was applied or dropped (stabilization window,
bounds), and only an applied change restarts the policy's timers.

The model is feed-forward plus PI on the error e = target - Q (anti-windup: the integral is
frozen while the count is pinned at a bound, and clamped to [0, 2 x target x integral_s]:
only additions read it); the proportional time R is
``refill_s`` or, by default (0), 2 x (T + 4 s); balance is ceil(D / p):

    n = ceil((D + (e + I / integral_s) / R) / p)

Rules, in order:

1. Cold start: until D and p are known, a cold pool (no worker active yet, or a trainer that has
   taken no batch) whose queue is short of the target starts every worker it may (the fastest
   way to a first batch; not a scale-up for the stabilization window, so the excess is shed as
   soon as both are known); otherwise the pool holds. A reconfigured pool keeps what the policy
   measured when only the parameters change.
2. Starving: no sample of the last two reaching a batch, and Q under 0.6 batch or the trainer
   seen to speed up within three start-ups (10 s at least; it then takes each batch as the
   envs complete it, and samples that fall mid-way through one average more than 0.6): the
   trainer waits and takes only what the envs make, so demand is at least that. Once a
   start-up has passed since the last applied addition, grow by 1 + (``max_up_factor`` - 1) x
   the hungry share (a dip in the jitter adds a worker or two; a trainer that sped up unseen
   doubles the pool per start-up; for three start-ups (10 s at least) after the trainer was
   seen to speed up by r while a batch waited (r: its quick rate, at that first reading or
   now, over the demand before; a trainer back from a pause faster than it went counts, the
   demand measured afresh), by up to r at once, where the hungry share
   would take a start-up to rise), unless the shared inference saturates (or the pool is at
   its maximum), and not while the last addition's workers have just become active, unless
   the trainer's quick rate has already risen by half of what they add (starving, that rate is
   what the pool makes: their groups are in, however short the start-up and the groups). A
   removal since a growth voids its test: the pool it grew is gone. A speed-up restarts Q (the
   queue averaged over the slower steps is another trainer's). No batch for the time the
   active workers at the measured p make two is an outage of production (inference down), not
   demand: the pool holds. Saturation is judged on the production measured, never on p x workers.
3. Add: a queue below the target that, projected a start-up ahead (or a step, where a step is
   longer; workers still starting count from half-way through a start-up), would fall below the
   band's bottom x min(step / start-up, 1)^2, or stays below the band: up to max(n, balance,
   count + 1) (not the + 1 while workers are still starting). Over a start-up of many steps
   the queue falls smoothly at the measured drift, and the bound is about empty (a larger one
   adds workers on the rates' noise: a reversal an hour more on a steady load); a trainer
   that steps seldom takes a whole batch at a time, and the queue, smoothed over two steps,
   reads a step late, so there the pool grows before the queue leaves the band, where the
   trainer starts to wait (a batch of 1024 every 44 s with 10-s start-ups: 4.1-5.2% of the
   time starved avoidably with a projection to empty, 1.0-1.5% with this).
   Within a start-up of a removal only a queue below the band adds workers, and nothing is
   added while the last addition's workers have just become active (their groups are still in
   generation), unless the measured demand needs more than the whole pool makes (a trainer
   that sped up: what is in generation does not change that).
4. Hold up to the band's top, while a batch waits but the trainer takes none for four steps (a
   pause, or a slowdown: the next step tells), and until demand has been measured after a pause.
   With ``pause_release_startups`` k > 0, a pause that has lasted k start-ups lets the pool go to
   its minimum and the trainer's next step brings the count back at once (p, measured with
   those workers, stays theirs: a slowdown taken for a pause costs a restart, not p): the workers
   of a long evaluation are not held idle, for about a start-up of waiting when it ends (0, the
   default: held through pauses, so the trainer is never caught short by one).
5. Remove when both Q and the latest sample are above the band, with hysteresis in whole workers (a
   fractional need would otherwise make the count alternate between neighbours): the count must
   exceed the need D / p by a whole worker plus the production spread in workers (how far
   production wanders over a start-up, or over a step where that is longer: the trainer sees
   nothing shorter), and, unless it exceeds it by twice that, for 3 start-ups and 8 steps in a row.
   The removal goes to max(ceil(need + spread), safe, count - ``max_down_fraction`` x count), where
   safe is the fewest workers that keep the queue inside the band for a start-up at the measured
   demand; workers still starting (they make nothing yet) go beyond that share, down to the
   workers up or twice the need, whichever is more (a cold pool that went to the maximum, its
   need measured from its first wave). p measured before a removal stays the pool's after it
   (each worker left makes at least what it made); after a growth it is measured afresh for two
   start-ups. p read under a quarter of what entered the queue per active worker was read
   where nothing could land (the envs restarting after the limit cancelled their groups, with
   groups longer than the steps the queue held): p rests on that instead, and at the limit
   the pool steps down as one whose p was never measured. At the off-policy limit (where p
   is not measured and may rest on its bound D / active, the need then reading as the whole
   pool) a twentieth of the pool at a time, but never below the need a p measured above that
   bound puts (each worker left makes at least what it made), unless the queue was full at
   every sample (below); with
   the queue held there for a whole cooldown, up to a tenth: the share whose shortfall (at most
   that share of D, since every worker makes at least D / n) the two batches above the band cover
   for a start-up, 2 steps / start-up. With the queue full (within an eighth of a batch of the
   limit, either side: a backlog above it proves nothing) at every sample for a whole cooldown
   while the trainer took batches, each batch taken was made again within a sample interval, so the
   pool makes at least D x (1 + step / interval): up to step / (interval + step) of it (and
   ``max_down_fraction``) goes at once, whatever p reads. A step is a whole worker at least, so
   one goes only where 1 / count is within the share the queue covers, or within the share of
   that sample-interval bound the samples found it full at (a small pool with long start-ups:
   a worker removed in error leaves 1 / count of D short until its replacement is up). Full at
   three samples in four or more, where the share of that bound the samples found it full at
   covers a worker and the share of the pool, the pool steps down by its share (up to what is
   proven, a tenth at most), not a worker off the need on the bound D / active (the whole
   pool). Full at half the samples or more and at the limit ever since the last removal, with
   start-ups of a minute or more, twice the pinned share (a tenth at most), not a worker: that
   removal did not take the queue off the limit, and a worker per start-up would hold the
   excess for most of an hour. At the limit the envs cancel their
   groups and start afresh at each take, so a refill is the pool making a batch from scratch:
   full again within w worker-seconds of each of the last four takes (from the sample before
   the take to the first full one, times the workers then; a smaller pool refills in fewer, so
   they carry over a removal and start again when workers come; a take before the queue is full
   again voids them), 2 w / s workers make twice what the trainer takes: down to that many, at
   most half the pool at a time, once the pool the last removal left has refilled (the cooldown
   does not apply: each take tests the pool); the shares above never take the pool under the
   count such a removal kept until workers come (they step on the bound D / active, which says
   nothing of a pool the refills sized), except a queue full at every sample for a cooldown,
   whose share rests on the sample interval instead. A pool held at the limit at three times
   the need p measured below it or more (p above its bound D / active, or a cold start's count
   of rule 1) halves, down to twice that need, a cooldown at a time, where start-ups take a
   minute or more (a twentieth per start-up would hold that excess for most of an hour; p read
   from a cold pool's first, fastest groups, or before groups grew longer, may read high, but
   twice the need leaves a need's worth). With
   the queue held at the limit for a whole cooldown by the workers up, every worker still starting
   goes at once (it would make nothing the trainer takes: a cold start that went to the maximum
   keeps only its first waves; not within a cooldown of a worker exiting early: the retries tell
   a crash loop). Once a count
   has been found short, a twentieth, and only down to the need plus the spread at the p last
   measured. No removal goes back to the last count found short (rule 3 added to it with the pool
   in place, its workers' groups in, and p measured over its window or the queue about to empty;
   or rule 3 or 2 added to it after this pool had held the queue at the limit), nor below the
   need that the demand then puts at the p measured now, unless demand fell by more than a
   worker makes and by 40%: that count emptied the queue once. At most once per
   max(``down_cooldown_s``, T, min(4 steps, 2 T)): each removal shows in the queue before the
   next. Flap damping: each removal that an addition undid while the need D / p had not risen
   by more than 10% (the removal was wrong: neither a faster trainer nor slower groups made the
   addition) widens what later removals keep by a whole worker plus the spread, and the excess
   a removal needs in proportion; such flaps count half as much after an hour, at most three
   count, and none once the need has fallen by more than 10% since the last (a slower trainer:
   a new load). Where jitter alone sometimes starves a count that the need says holds
   (minute-long groups, whose queue swings from empty to the off-policy limit), the pool then
   settles higher instead of cycling between that count and a growth.

What no count fixes is reported (``Decision.alerts``): ``offpolicy_stalls`` from the third time
within 30 minutes the queue fell from the off-policy limit to under a batch with less than a batch
landing, and less than half of what the workers active make at their measured production (a short
pool landing what it makes waits on itself), and the trainer then waited a step or more (or, within
a settle time of the limit, took a step fewer than it had time for: a wait shorter than the sample
interval; not while it steps through what it took since the visit: atroposlib's ``/batch`` hands
it every full batch at once, so a take at the limit leaves the queue under a batch at once),
until 30 minutes pass without one. Groups outlast the batches the queue held there, and
the envs stopped at the limit (atroposlib's cancel the groups in generation), so each visit costs a
wait whatever the pool: the remedy is a larger ``max_batches_offpolicy`` or shorter groups. While
such a fall has landed less than a batch, the pool holds (rule 3 does not read it as a short pool).
Once reported, ahead of rules 2-5 (:mod:`.stalls`): a queue short of the target within two stalls'
spans of the limit (the last wait and the batches the limit holds) holds the pool, and each new
stall, a start-up after the last change, takes ``STALL_SHARE`` (a quarter) of it: fewer workers
reach the limit less often, and none shortens the wait. A growth after such a step (the pool went
below its need) is the floor for the next ones until no stall is left in the window. A trainer
restart, a flushed queue or a pool with no worker active since the last visit ends that reading:
the queue is short for that, and the rules below decide."""

from core.policies.buffer.memory import BufferMemory
from core.policies.buffer.policy import BufferPolicy

__all__ = ["BufferMemory", "BufferPolicy"]
