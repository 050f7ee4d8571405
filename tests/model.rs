//! The claim protocol on a lease store, model-checked in every
//! interleaving (stateright, breadth first) up to a bound: three handlers
//! (two with one payload, one with another) that claim, heartbeat, do the
//! work, complete and retry; a clock; crashes at any step; pauses past the
//! lease (the clock runs while a handler waits); claims and completions
//! whose answer is lost, applied or not; an operator's forced forget. The
//! store has the conditional operations the real lease stores have — a
//! claim that returns what it met, extend and complete fenced by the lease
//! token and by expiry, a takeover of a lapsed claim — and what a found
//! record means is decided by the shipped rule, `store::Found::decide`,
//! called here, not rewritten.
//!
//! Properties: a second execution only as a takeover of a lapsed claim
//! (which the handler is told of); a completed record never replaced by a
//! claim or by an older attempt's completion; a completion fenced off by a
//! forced forget stores nothing; a replay never carries what another
//! payload produced. Each can fail: a planted bug — an unfenced
//! completion, an orphan recovery that overwrites what it read (the
//! Powertools bug), a claim that hides what it met, a replay that skips
//! the fingerprint — breaks the property that names it, and the failing
//! interleaving is printed.

use std::{
    sync::Arc,
    time::{Duration, UNIX_EPOCH},
};

use stateright::{Checker, Model, Property};
use tower_idempotency::{
    CompletedRecord, Fingerprint,
    store::{Claim, Found, FoundState},
};

/// A lease, in ticks of the model's clock.
const LEASE: u8 = 2;
/// The clock stops here: the bound that keeps the state space finite.
const HORIZON: u8 = 5;
/// How many store answers the network loses in one run.
const LOSSES: u8 = 2;
/// Each handler's payload: two duplicates and one other.
const PAYLOADS: [u8; 3] = [0, 0, 1];

/// A bug the store can have, to show each property can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Bug {
    None,
    /// A completion stores whatever the key holds, its token and expiry
    /// unchecked.
    UnfencedCompletion,
    /// A claim that meets a completed record overwrites it (it read the
    /// record, then wrote its claim unconditionally).
    OrphanOverwrite,
    /// A claim that meets a live claim grants the key anyway.
    ClaimHidesWhatItMet,
    /// A found record is judged without its fingerprint.
    NoFingerprint,
}

/// What the key holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Stored {
    Claimed {
        token: u8,
        payload: u8,
        until: u8,
    },
    /// `effect`: the index of the execution whose answer it keeps.
    Completed {
        payload: u8,
        effect: u8,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// About to claim (again).
    Ready,
    /// Holds the claim `token`, granted over a lapsed one when `takeover`,
    /// after `epoch` forced forgets.
    Holding {
        token: u8,
        takeover: bool,
        epoch: u8,
    },
    /// Did the work (execution `effect`) under `token`; completing.
    Worked {
        token: u8,
        effect: u8,
    },
    Answered(Answer),
    Crashed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Answer {
    Executed,
    /// Replayed execution `effect`'s answer.
    Replayed {
        effect: u8,
    },
    Mismatch,
    /// Its completion was refused (fenced off) or its answer lost: an
    /// error, nothing stored by it.
    Failed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Execution {
    handler: u8,
    payload: u8,
    token: u8,
    takeover: bool,
    /// Forced forgets before its claim: each starts the key over.
    epoch: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    clock: u8,
    stored: Option<Stored>,
    tokens: u8,
    handlers: Vec<Phase>,
    executions: Vec<Execution>,
    /// Set when a completed record gave way to anything but a forget.
    replaced: bool,
    /// Set when a completion stored an execution whose claim a forced
    /// forget had ended.
    stored_after_forget: bool,
    /// Tokens whose claim a forced forget ended.
    forgotten: Vec<u8>,
    forgets: u8,
    /// Store answers lost so far (at most [`LOSSES`]).
    losses: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    Claim(u8),
    /// A claim applied by the store whose answer the handler never got: it
    /// claims again.
    ClaimAnswerLost(u8),
    Heartbeat(u8),
    Work(u8),
    Complete(u8),
    /// A completion applied or not, its answer lost.
    CompleteAnswerLost(u8, bool),
    Crash(u8),
    ForceForget,
}

struct Protocol {
    bug: Bug,
    /// Checks only this property (a search that stops at its discovery).
    only: Option<&'static str>,
}

fn fingerprint(payload: u8) -> Fingerprint {
    Fingerprint::from_bytes([payload; 32])
}

fn record() -> Arc<CompletedRecord> {
    Arc::new(CompletedRecord::Unreplayable {
        status: http::StatusCode::CREATED,
        created_at: UNIX_EPOCH,
    })
}

impl Protocol {
    /// The store's claim: a free key, or one whose claim lapsed, is
    /// granted; anything else found is decided by the shipped rule.
    /// `Ok(takeover)` when granted.
    fn claim(&self, state: &mut State, payload: u8) -> Result<(u8, bool), Claim<u8>> {
        let lapsed =
            matches!(state.stored, Some(Stored::Claimed { until, .. }) if until <= state.clock);
        let grant = match &state.stored {
            None => true,
            Some(Stored::Claimed { .. }) if lapsed => true,
            Some(Stored::Claimed { .. }) => self.bug == Bug::ClaimHidesWhatItMet,
            Some(Stored::Completed { .. }) => self.bug == Bug::OrphanOverwrite,
        };
        if grant {
            if matches!(state.stored, Some(Stored::Completed { .. })) {
                state.replaced = true;
            }
            state.tokens += 1;
            let token = state.tokens;
            state.stored = Some(Stored::Claimed {
                token,
                payload,
                until: state.clock + LEASE,
            });
            return Ok((token, lapsed));
        }
        let found = match state.stored.clone().expect("found") {
            Stored::Claimed {
                payload: stored,
                until,
                ..
            } => Found::<u8> {
                fingerprint: Ok(fingerprint(stored)),
                state: FoundState::InFlight {
                    retry_after: Duration::from_secs(u64::from(until - state.clock)),
                    ours: None,
                },
            },
            Stored::Completed {
                payload: stored, ..
            } => Found {
                fingerprint: Ok(fingerprint(if self.bug == Bug::NoFingerprint {
                    payload
                } else {
                    stored
                })),
                state: FoundState::Completed {
                    record: Ok(record()),
                    expires_in: Duration::from_secs(3600),
                },
            },
        };
        Err(found.decide(&fingerprint(payload)).expect("readable"))
    }

    /// The store's completion, fenced by the token and the lease's expiry.
    fn complete(&self, state: &mut State, token: u8, effect: u8) -> bool {
        let held = matches!(
            state.stored,
            Some(Stored::Claimed { token: t, until, .. }) if t == token && until > state.clock
        );
        let unfenced = self.bug == Bug::UnfencedCompletion && state.stored.is_some();
        if !(held || unfenced) {
            return false;
        }
        if matches!(state.stored, Some(Stored::Completed { .. })) {
            state.replaced = true;
        }
        if state.forgotten.contains(&token) {
            state.stored_after_forget = true;
        }
        let payload = state.executions[usize::from(effect)].payload;
        state.stored = Some(Stored::Completed { payload, effect });
        true
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            clock: 0,
            stored: None,
            tokens: 0,
            handlers: vec![Phase::Ready; PAYLOADS.len()],
            executions: Vec::new(),
            replaced: false,
            stored_after_forget: false,
            forgotten: Vec::new(),
            forgets: 0,
            losses: 0,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.clock < HORIZON {
            actions.push(Action::Tick);
        }
        if state.forgets == 0 && matches!(state.stored, Some(Stored::Claimed { .. })) {
            actions.push(Action::ForceForget);
        }
        for (i, phase) in state.handlers.iter().enumerate() {
            let i = i as u8;
            match phase {
                Phase::Ready => {
                    actions.push(Action::Claim(i));
                    if state.losses < LOSSES {
                        actions.push(Action::ClaimAnswerLost(i));
                    }
                }
                Phase::Holding { .. } => {
                    actions.push(Action::Heartbeat(i));
                    actions.push(Action::Work(i));
                    actions.push(Action::Crash(i));
                }
                Phase::Worked { .. } => {
                    actions.push(Action::Heartbeat(i));
                    actions.push(Action::Complete(i));
                    if state.losses < LOSSES {
                        actions.push(Action::CompleteAnswerLost(i, true));
                        actions.push(Action::CompleteAnswerLost(i, false));
                    }
                    actions.push(Action::Crash(i));
                }
                Phase::Answered(_) | Phase::Crashed => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => state.clock += 1,
            Action::ForceForget => {
                if let Some(Stored::Claimed { token, .. }) = state.stored {
                    state.forgotten.push(token);
                }
                state.stored = None;
                state.forgets += 1;
            }
            Action::Claim(i) => {
                let payload = PAYLOADS[usize::from(i)];
                state.handlers[usize::from(i)] = match self.claim(&mut state, payload) {
                    Ok((token, takeover)) => Phase::Holding {
                        token,
                        takeover,
                        epoch: state.forgets,
                    },
                    // Another attempt holds it: asked again later.
                    Err(Claim::InFlight { .. }) => return None,
                    Err(Claim::Mismatch) => Phase::Answered(Answer::Mismatch),
                    Err(Claim::Completed { .. }) => match state.stored {
                        Some(Stored::Completed { effect, .. }) => {
                            Phase::Answered(Answer::Replayed { effect })
                        }
                        _ => unreachable!("a replay of a completed record"),
                    },
                    Err(Claim::Acquired(_)) => unreachable!("granted above"),
                };
            }
            Action::ClaimAnswerLost(i) => {
                // Applied, unheard: the handler stays ready, its grant
                // orphaned until its lease lapses.
                let payload = PAYLOADS[usize::from(i)];
                if self.claim(&mut state, payload).is_err() {
                    return None;
                }
                state.losses += 1;
            }
            Action::Heartbeat(i) => {
                let (Phase::Holding { token, .. } | Phase::Worked { token, .. }) =
                    state.handlers[usize::from(i)]
                else {
                    return None;
                };
                match &mut state.stored {
                    Some(Stored::Claimed {
                        token: t, until, ..
                    }) if *t == token && *until > last.clock => {
                        *until = last.clock + LEASE;
                    }
                    _ => return None,
                }
            }
            Action::Work(i) => {
                let Phase::Holding {
                    token,
                    takeover,
                    epoch,
                } = state.handlers[usize::from(i)]
                else {
                    return None;
                };
                state.executions.push(Execution {
                    handler: i,
                    payload: PAYLOADS[usize::from(i)],
                    token,
                    takeover,
                    epoch,
                });
                let effect = (state.executions.len() - 1) as u8;
                state.handlers[usize::from(i)] = Phase::Worked { token, effect };
            }
            Action::Complete(i) | Action::CompleteAnswerLost(i, true) => {
                let Phase::Worked { token, effect } = state.handlers[usize::from(i)] else {
                    return None;
                };
                let stored = self.complete(&mut state, token, effect);
                if !matches!(action, Action::Complete(_)) {
                    state.losses += 1;
                }
                state.handlers[usize::from(i)] =
                    Phase::Answered(if stored && matches!(action, Action::Complete(_)) {
                        Answer::Executed
                    } else {
                        Answer::Failed
                    });
            }
            Action::CompleteAnswerLost(i, false) => {
                state.handlers[usize::from(i)] = Phase::Answered(Answer::Failed);
                state.losses += 1;
            }
            Action::Crash(i) => state.handlers[usize::from(i)] = Phase::Crashed,
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            // An operator's forced forget of a key in flight starts it
            // over: counted from each forget on.
            Property::always(
                "a second execution only as a takeover of a lapsed claim",
                |_: &Protocol, state: &State| {
                    (0..=state.forgets).all(|epoch| {
                        state
                            .executions
                            .iter()
                            .filter(|e| e.epoch == epoch && !e.takeover)
                            .count()
                            <= 1
                    })
                },
            ),
            Property::always(
                "a completed record is never replaced",
                |_: &Protocol, state: &State| !state.replaced,
            ),
            Property::always(
                "a completion fenced off by a forced forget stores nothing",
                |_: &Protocol, state: &State| !state.stored_after_forget,
            ),
            Property::always(
                "a replay never carries what another payload produced",
                |_: &Protocol, state: &State| {
                    state
                        .handlers
                        .iter()
                        .enumerate()
                        .all(|(i, phase)| match phase {
                            Phase::Answered(Answer::Replayed { effect }) => {
                                state.executions[usize::from(*effect)].payload == PAYLOADS[i]
                            }
                            _ => true,
                        })
                },
            ),
            Property::sometimes(
                "a takeover executes again",
                |_: &Protocol, state: &State| state.executions.iter().any(|e| e.takeover),
            ),
            Property::sometimes("a duplicate replays", |_: &Protocol, state: &State| {
                state
                    .handlers
                    .iter()
                    .any(|p| matches!(p, Phase::Answered(Answer::Replayed { .. })))
            }),
        ];
        if let Some(only) = self.only {
            properties.retain(|p| p.name == only);
        }
        properties
    }
}

/// The properties the model with `bug` breaks (of `only`, or all), each
/// with the interleaving that broke it, and how many states it explored.
fn broken(bug: Bug, only: Option<&'static str>) -> (Vec<(&'static str, String)>, usize) {
    let checker = Protocol { bug, only }.checker().spawn_bfs().join();
    let mut broken = Vec::new();
    for property in (Protocol { bug, only }).properties() {
        let found = checker.discovery(property.name);
        let always = !matches!(
            property.name,
            "a takeover executes again" | "a duplicate replays"
        );
        match (always, found) {
            (true, Some(path)) => {
                broken.push((property.name, format!("{:#?}", path.into_actions())))
            }
            (false, None) => broken.push((property.name, "never reached".to_owned())),
            _ => {}
        }
    }
    (broken, checker.unique_state_count())
}

#[test]
fn the_shipped_protocol_keeps_every_property_in_every_interleaving() {
    let (broken, states) = broken(Bug::None, None);
    assert!(broken.is_empty(), "{broken:#?}");
    // The bound is what it is: a change that shrinks the model shows here.
    assert!(states > 10_000, "only {states} states explored");
    eprintln!("{states} states, every property kept");
}

#[test]
fn each_property_fails_against_its_planted_bug() {
    let planted = [
        (
            Bug::UnfencedCompletion,
            "a completed record is never replaced",
        ),
        (Bug::OrphanOverwrite, "a completed record is never replaced"),
        (
            Bug::ClaimHidesWhatItMet,
            "a second execution only as a takeover of a lapsed claim",
        ),
        (
            Bug::NoFingerprint,
            "a replay never carries what another payload produced",
        ),
        (
            Bug::UnfencedCompletion,
            "a completion fenced off by a forced forget stores nothing",
        ),
    ];
    // Side by side; each search stops at its property's counterexample.
    std::thread::scope(|scope| {
        let checks: Vec<_> = planted
            .iter()
            .map(|&(bug, property)| {
                scope.spawn(move || (bug, property, broken(bug, Some(property)).0))
            })
            .collect();
        for check in checks {
            let (bug, property, broken) = check.join().expect("the search runs to its end");
            assert!(
                broken.iter().any(|(name, _)| *name == property),
                "{bug:?} should break {property:?}; broke {broken:#?}"
            );
        }
    });
}
