//! The learning-rate schedule of the train example, and the plan of a run under a wall-clock
//! budget (`--minutes`).
//!
//! The rate warms up linearly over `warmup` steps to `lr`, then follows the run's schedule, a
//! function of the step and the run's length `steps`:
//!
//! - `cosine`: a cosine from `lr` down to `final_lr_frac · lr` at the last step;
//! - `wsd` (warm-up, stable, decay; `tools/train.py`'s): `lr` until the last `cooldown_frac` of
//!   the steps, then a straight line down to `final_lr_frac · lr` at the last step.
//!
//! A timed run does not know its length in advance. As `tools/train.py` does, it takes the
//! wall-clock time per step from the 3rd step of the invocation on (the first steps carry one-time
//! costs), and every 10 steps, once 5 steps have been timed, plans the length as the steps done
//! plus 98 % of the steps the time left allows (at most `--steps`). The first plan of a new run
//! caps the warm-up at a tenth of the planned steps. A `wsd` run stops re-planning once its decay
//! has begun, so the decay ends at the planned step; a `cosine` run re-plans to the end, as its
//! rate depends on the length at every step. Training stops after the planned last step or after
//! the step that crosses the deadline, whichever comes first; the checkpoint then records the
//! steps done as the run's length.

use std::time::{Duration, Instant};

use crate::cli::{Schedule, Settings};

/// The learning rate of update `step` (from 0) of a run of `s.steps` steps (see the module doc).
pub fn lr_at(s: &Settings, step: usize) -> f64 {
    if step < s.warmup {
        return s.lr * (step + 1) as f64 / s.warmup as f64;
    }
    let floor = s.final_lr_frac;
    match s.schedule {
        Schedule::Cosine => {
            let decay_steps = (s.steps - s.warmup).saturating_sub(1).max(1);
            let progress = ((step - s.warmup) as f64 / decay_steps as f64).min(1.0);
            let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
            s.lr * (floor + (1.0 - floor) * cosine)
        }
        Schedule::Wsd => {
            let start = cooldown_start(s);
            if step < start {
                return s.lr;
            }
            let last = s.steps.saturating_sub(1);
            let span = last.saturating_sub(start).max(1);
            let progress = ((step - start) as f64 / span as f64).min(1.0);
            s.lr * (1.0 - (1.0 - floor) * progress)
        }
    }
}

/// The first step of a `wsd` decay: the last `cooldown_frac` of the steps, after the warm-up.
pub fn cooldown_start(s: &Settings) -> usize {
    let stable = (s.steps as f64 * (1.0 - s.cooldown_frac)) as usize;
    stable.max(s.warmup)
}

/// The step of an invocation (from 1) at which the timing of steps starts.
const TIMED_FROM: usize = 3;
/// Steps timed before the first plan, and steps between plans.
const TIMED_BEFORE_PLAN: usize = 5;
const PLAN_EVERY: usize = 10;
/// The share of the time left that a plan fills with steps, a margin for slower steps.
const FILL: f64 = 0.98;

/// The wall-clock budget of a timed run and its plan (see the module doc).
pub struct Budget {
    deadline: Instant,
    /// The most steps a plan may take (`--steps`).
    cap: usize,
    /// Steps done by this invocation.
    here: usize,
    /// When the timing started, and the run's step count then.
    reference: Option<(Instant, usize)>,
    /// Whether the next plan is the first of a new run (which caps the warm-up).
    first_plan_of_run: bool,
    /// Whether the plan is final (a `wsd` decay has begun).
    fixed: bool,
}

impl Budget {
    /// The budget of an invocation that started at `start`: `minutes` in all, of which
    /// `reserve_s` seconds are kept after training; `new_run` when it starts at step 0.
    pub fn new(start: Instant, minutes: f64, reserve_s: f64, cap: usize, new_run: bool) -> Self {
        let training = Duration::from_secs_f64((minutes * 60.0 - reserve_s).max(0.0));
        Self {
            deadline: start + training,
            cap,
            here: 0,
            reference: None,
            first_plan_of_run: new_run,
            fixed: false,
        }
    }

    /// Whether a step that ended at `now` is the last one the budget allows.
    pub fn expired(&self, now: Instant) -> bool {
        now >= self.deadline
    }

    /// Accounts for a step that ended at `now` with `done` steps of the run done, and plans the
    /// run's length (`s.steps`, and at the first plan of a new run `s.warmup`) when a plan is
    /// due; returns a line describing a new plan.
    pub fn after_step(&mut self, s: &mut Settings, done: usize, now: Instant) -> Option<String> {
        self.here += 1;
        if self.here == TIMED_FROM {
            self.reference = Some((now, done));
        }
        let (since, timed_from) = self.reference?;
        let timed = done - timed_from;
        if self.fixed || timed < TIMED_BEFORE_PLAN || done % PLAN_EVERY != 0 {
            return None;
        }
        let per_step = now.duration_since(since).as_secs_f64() / timed as f64;
        let left = self.deadline.saturating_duration_since(now).as_secs_f64();
        let more = (FILL * left / per_step.max(1e-9)) as usize;
        s.steps = done.saturating_add(more).min(self.cap).max(done);
        let mut note = String::new();
        if self.first_plan_of_run {
            self.first_plan_of_run = false;
            s.warmup = s.warmup.min((s.steps / 10).max(1));
            note = format!(", warm-up {}", s.warmup);
        }
        if s.schedule == Schedule::Wsd && done >= cooldown_start(s) {
            self.fixed = true;
            note.push_str(&format!(", the decay from step {} on", cooldown_start(s)));
        }
        Some(format!(
            "{:.1} ms per step ({:.0} tokens/s): planning {} steps{note}",
            per_step * 1e3,
            s.tokens_per_step() as f64 / per_step,
            s.steps
        ))
    }
}
