"""The buffer policy's fixed numbers, each with why (the tunables are its parameters)."""

#: Steps the demand estimate spans, and the quick estimate that catches a speed-up.
DEMAND_STEPS = 30.0
FAST_STEPS = 3.0
#: For this many start-ups after the trainer was seen to speed up, a starving trainer's growth
#: takes the factor its quick rate rose by (up to ``max_up_factor``).
SPEEDUP_STARTUPS = 3.0
#: ... and for this long at least: with start-ups of a second, three of them end before the
#: groups that the first growth brings have landed.
SPEEDUP_MIN_S = 10.0
#: Steps without an advance, with a batch waiting, that make a pause.
PAUSE_STEPS = 4.0
#: A removal within twice its margin waits this many start-ups plus trainer steps of excess.
REMOVAL_STARTUPS = 3.0
REMOVAL_STEPS = 8.0
#: Starving, no batch for the time the pool makes this many at its measured rate: an outage.
OUTAGE_BATCHES = 2.0
#: Start-ups a knee found by removals (the count the shared inference saturates at) holds.
KNEE_STARTUPS = 30.0
#: Production per worker below this share of its best at the maximum: a sign of saturation.
FELL = 0.7
#: A smaller pool whose production fell by less than this share of the workers removed (a
#: quarter of a proportional fall): saturated.
HELD = 0.25
#: A step past the knee loses what it removes until it is judged and brought back: at most this
#: many seconds of the pool's production (1% of an hour) per step, and at most a quarter.
PAST_KNEE_COST_S = 36.0
SHED_MAX_SHARE = 1 / 4
#: At the off-policy limit a removal takes a twentieth of the pool; with the queue held there
#: for a whole cooldown, up to a tenth (the batches the full queue holds above the band cover
#: the shortfall for this many trainer steps per start-up).
LIMIT_SHARE = 1 / 20
PINNED_SHARE = 1 / 10
PINNED_STEPS = 2.0
#: A pool held at the limit at this many times the need p measured below it or more (p above
#: its bound D / active, or a cold start's count: every worker it may have, before any rate
#: was known) halves, down to twice that need, a cooldown at a time, where start-ups take at
#: least ``COLD_HALVING_STARTUP_S``: there a twentieth per start-up would hold the excess for
#: most of an hour. (With shorter start-ups the shares above shed it within minutes, and a
#: pool halved to a few workers grows back too slowly after a faster trainer.)
FAR_NEEDS = 3.0
COLD_HALVING_STARTUP_S = 60.0
#: Samples at the off-policy limit before the share of them that found the queue full counts.
LIMIT_SAMPLES = 8
#: Found full at this share of them or more (where what that proves covers the step), a
#: removal at the limit takes the pool's share, up to what is proven, not a worker (below it,
#: a worker at most).
FULL_SAMPLES_SHARE = 3 / 4
#: Found full at this share of them or more, and at the limit ever since the last removal,
#: where start-ups take at least ``COLD_HALVING_STARTUP_S``: twice the pinned share, not a
#: worker (the excess would take most of an hour to shed a worker per start-up).
HELD_FULL_SHARE = 1 / 2
#: Refills of the full queue that bound what a pool makes (the slowest of the last this many),
#: and the share of a trainer step the slowest may take for a removal to rest on them: a pool
#: that makes a batch from scratch in half a step makes twice what the trainer takes (the
#: other half covers heavy tails, whose shortest groups refill the queue faster than the
#: pool makes once it is off the limit). At most half the pool goes at a time.
REFILL_TAKES = 4
REFILL_MARGIN = 2.0
REFILL_MAX_SHARE = 1 / 2
#: A sample this close to the off-policy limit (in batches, either side) finds the queue full.
FULL_SLACK_BATCHES = 1 / 8
#: At the off-policy limit p above D / active by more than this share is measured, not its
#: bound (the rates' noise is a few percent): its need floors the descent there.
BOUND_SLACK = 1.05
#: A removal keeps workers still starting only up to this many times the need.
STARTING_NEEDS = 2.0
#: A removal undone by an addition while the measured need (D / p) is no more than this share of
#: what it was then was a flap; flaps count half as much after this long, and at most this many
#: count.
SAME_LOAD = 1.1
FLAP_HALF_LIFE_S = 3600.0
FLAPS_MAX = 3.0
#: The trainer left waiting a step with less than a batch landing after the queue fell from the
#: off-policy limit this many times within the window: reported (``offpolicy_stalls``).
STALLS_TO_ALERT = 3
STALL_WINDOW_S = 1800.0
#: Once they are reported, each new one takes this share of the pool, and a queue short of the
#: target within this many stalls' spans of the limit (a wait and the batches the limit holds)
#: holds it (:mod:`.stalls`).
STALL_SHARE = 1 / 4
STALL_SPANS = 2.0
#: A growth while starving passes its test early on what the grown pool made over this many
#: steps (and seconds) once its workers were in.
PROBE_STEPS = 8.0
PROBE_MIN_S = 30.0
#: p is also measured over this share of its window; where that reads this share of p or
#: less, production per worker is falling (groups growing longer) and it is used instead.
RECENT_WINDOW_SHARE = 1 / 4
FALLING = 0.9
#: Production per worker measured below what entered the queue per worker by more than this
#: factor is taken for a measurement of intervals in which nothing could land.
CENSORED_RATIO = 4.0
