//! The store contract as a model: a reference of what each key holds —
//! absent, claimed (its token and lease), completed (its fingerprint,
//! record and expiry) — driven by random sequences of claims, extensions,
//! completions, releases, forgets, inspects and the passing of time, and
//! compared with what the store answers at each step. A sequence the store
//! diverges on is shrunk, step by step, to the shortest that still
//! diverges.
//!
//! Time is the store's own: the model knows a deadline only to within a
//! margin (one time unit) around it, and accepts either answer there,
//! following what the store said.

use std::{
    fmt,
    future::Future,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use bytes::Bytes;

use crate::{
    CompletedRecord, Fingerprint, IdempotencyKey,
    store::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store},
};

/// One step of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Claim {
        key: usize,
        fp: usize,
    },
    Extend {
        key: usize,
        token: usize,
    },
    Complete {
        key: usize,
        token: usize,
        long: bool,
    },
    Release {
        key: usize,
        token: usize,
    },
    Forget {
        key: usize,
        force: bool,
    },
    Inspect {
        key: usize,
    },
    Sleep {
        units: u32,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Claim { key, fp } => write!(f, "claim k{key} with fingerprint {fp}"),
            Self::Extend { key, token } => write!(f, "extend k{key} with token #{token}"),
            Self::Complete { key, token, long } => {
                let retention = if *long { "a day" } else { "6 units" };
                write!(f, "complete k{key} with token #{token}, kept {retention}")
            }
            Self::Release { key, token } => write!(f, "release k{key} with token #{token}"),
            Self::Forget { key, force } => {
                write!(f, "forget k{key}{}", if *force { ", forced" } else { "" })
            }
            Self::Inspect { key } => write!(f, "inspect k{key}"),
            Self::Sleep { units } => write!(f, "wait {units} units"),
        }
    }
}

const KEYS: usize = 2;
const LEASE_UNITS: u32 = 4;
const SHORT_RETENTION_UNITS: u32 = 6;

/// A random sequence of `len` steps.
pub(super) fn sequence(rng: &mut fastrand::Rng, len: usize, inspect: bool) -> Vec<Step> {
    (0..len)
        .map(|_| {
            let key = rng.usize(..KEYS);
            let token = rng.usize(..8);
            match rng.u32(..20) {
                0..=5 => Step::Claim {
                    key,
                    fp: rng.usize(..2),
                },
                6..=7 => Step::Extend { key, token },
                8..=10 => Step::Complete {
                    key,
                    token,
                    long: rng.bool(),
                },
                11..=12 => Step::Release { key, token },
                13..=14 if inspect => Step::Forget {
                    key,
                    force: rng.u32(..4) == 0,
                },
                15..=16 if inspect => Step::Inspect { key },
                _ => Step::Sleep {
                    units: rng.u32(1..=3),
                },
            }
        })
        .collect()
}

/// What the model holds for a key.
#[derive(Clone, Debug)]
enum Slot {
    Absent,
    Claimed {
        token: usize,
        fp: usize,
        until: Instant,
        /// The claims of the key begun and lapsed before this one.
        lapsed: u32,
    },
    Completed {
        fp: usize,
        record: usize,
        until: Instant,
    },
}

/// Where now stands against a deadline, to within the margin.
#[derive(Clone, Copy, PartialEq, Eq)]
enum When {
    Before,
    Around,
    After,
}

struct Model {
    slots: [Slot; KEYS],
    margin: Duration,
}

impl Model {
    fn when(&self, until: Instant) -> When {
        let now = Instant::now();
        if now + self.margin < until {
            When::Before
        } else if now > until + self.margin {
            When::After
        } else {
            When::Around
        }
    }

    /// The slot as it stands: a slot whose deadline passed for sure is
    /// absent.
    fn live(&self, key: usize) -> (Slot, When) {
        match &self.slots[key] {
            Slot::Absent => (Slot::Absent, When::After),
            slot @ (Slot::Claimed { until, .. } | Slot::Completed { until, .. }) => {
                match self.when(*until) {
                    When::After => (Slot::Absent, When::After),
                    when => (slot.clone(), when),
                }
            }
        }
    }
}

/// A divergence: the step, what the model allowed, what the store said.
pub(super) struct Divergence {
    pub(super) at: usize,
    pub(super) expected: String,
    pub(super) got: String,
}

/// Runs `steps` against `store` from a fresh model; the first divergence.
pub(super) async fn run<St: Store<Granted = LeaseToken>>(
    store: &St,
    steps: &[Step],
    unit: Duration,
) -> Option<Divergence> {
    let tag = fastrand::u64(..);
    let keys: Vec<StorageKey> = (0..KEYS)
        .map(|k| {
            StorageKey::new(
                "tower-idempotency:model",
                &IdempotencyKey::new(format!("model-{tag}-k{k}")).expect("a valid key"),
            )
        })
        .collect();
    let fps = [
        Fingerprint::from_bytes([1; 32]),
        Fingerprint::from_bytes([2; 32]),
    ];
    let mut model = Model {
        slots: [Slot::Absent, Slot::Absent],
        margin: unit,
    };
    let mut tokens: Vec<LeaseToken> = Vec::new();
    let mut records: Vec<Arc<CompletedRecord>> = Vec::new();
    let lease = unit * LEASE_UNITS;
    // A token no claim granted: a stranger's.
    let stranger = LeaseToken::generate();
    let token_of = |tokens: &Vec<LeaseToken>, i: usize| -> (Option<usize>, LeaseToken) {
        if i < tokens.len() {
            (Some(i), tokens[i])
        } else {
            (None, stranger)
        }
    };
    for (at, step) in steps.iter().enumerate() {
        let diverged = |expected: &str, got: String| {
            Some(Divergence {
                at,
                expected: expected.to_owned(),
                got,
            })
        };
        match *step {
            Step::Sleep { units } => tokio::time::sleep(unit * units).await,
            Step::Claim { key, fp } => {
                let (slot, when) = model.live(key);
                let claim = store.claim(&keys[key], &fps[fp], lease).await;
                let claim = match claim {
                    Ok(claim) => claim,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                // What a live slot answers; around its deadline, a claim too.
                let held = match &slot {
                    Slot::Absent => None,
                    Slot::Claimed { fp: held, .. } if *held == fp => Some("InFlight"),
                    Slot::Completed { fp: held, .. } if *held == fp => Some("Completed"),
                    _ => Some("Mismatch"),
                };
                // A grant over a claim that lapsed is a takeover, counting
                // on, on a store that reports them.
                let lapsed = match model.slots[key] {
                    Slot::Claimed { lapsed, .. } if St::REPORTS_TAKEOVERS => Some(lapsed + 1),
                    _ => None,
                };
                let grant = if lapsed.is_some() {
                    "TakenOver"
                } else {
                    "Acquired"
                };
                let name = claim_name(&claim);
                let allowed = match (held, when) {
                    (None, _) => vec![grant],
                    (Some(held), When::Around) => vec![held, grant],
                    (Some(held), _) => vec![held],
                };
                if !allowed.contains(&name) {
                    return diverged(&allowed.join(" or "), name.into());
                }
                match claim {
                    Claim::Acquired(token) | Claim::TakenOver { granted: token, .. } => {
                        if let Claim::TakenOver { lapsed: told, .. } = claim
                            && Some(told.attempts) != lapsed
                        {
                            let expected = format!("a takeover of {lapsed:?} attempts");
                            return diverged(&expected, format!("{}", told.attempts));
                        }
                        tokens.push(token);
                        model.slots[key] = Slot::Claimed {
                            token: tokens.len() - 1,
                            fp,
                            until: Instant::now() + lease,
                            lapsed: lapsed.unwrap_or(0),
                        };
                    }
                    Claim::Completed { record, .. } => {
                        if let Slot::Completed { record: mine, .. } = slot
                            && *record != *records[mine]
                        {
                            return diverged("the key's own record", "another record".into());
                        }
                    }
                    _ => {}
                }
            }
            Step::Extend { key, token } => {
                let (slot, when) = model.live(key);
                let (index, token) = token_of(&tokens, token);
                let holds = matches!(slot, Slot::Claimed { token: t, .. } if Some(t) == index);
                let got = match store.extend(&keys[key], token, lease).await {
                    Ok(got) => got,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                if got != holds && !(holds && when == When::Around) {
                    return diverged(&holds.to_string(), got.to_string());
                }
                if got && let Slot::Claimed { until, .. } = &mut model.slots[key] {
                    *until = Instant::now() + lease;
                }
            }
            Step::Complete { key, token, long } => {
                let (slot, when) = model.live(key);
                let (index, mut token) = token_of(&tokens, token);
                let holds = matches!(slot, Slot::Claimed { token: t, .. } if Some(t) == index);
                let record = Arc::new(record(records.len()));
                let retention = if long {
                    Duration::from_secs(86_400)
                } else {
                    unit * SHORT_RETENTION_UNITS
                };
                let fp = match slot {
                    Slot::Claimed { fp, .. } => fp,
                    _ => 0,
                };
                let got = store
                    .complete(&keys[key], &mut token, &fps[fp], record.clone(), retention)
                    .await;
                let got = match got {
                    Ok(got) => got,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                if got != holds && !(holds && when == When::Around) {
                    return diverged(&holds.to_string(), got.to_string());
                }
                if got {
                    records.push(record);
                    model.slots[key] = Slot::Completed {
                        fp,
                        record: records.len() - 1,
                        until: Instant::now() + retention,
                    };
                }
            }
            Step::Release { key, token } => {
                let (slot, when) = model.live(key);
                let (index, token) = token_of(&tokens, token);
                let holds = matches!(slot, Slot::Claimed { token: t, .. } if Some(t) == index);
                // A lease that ran out and that nobody claimed since is
                // still this token's to give back: either answer is safe.
                let lapsed = !holds
                    && matches!(model.slots[key], Slot::Claimed { token: t, .. } if Some(t) == index);
                let got = match store.release(&keys[key], token).await {
                    Ok(got) => got,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                if got != holds && !(holds && when == When::Around) && !lapsed {
                    return diverged(&holds.to_string(), got.to_string());
                }
                if got {
                    model.slots[key] = Slot::Absent;
                }
            }
            Step::Forget { key, force } => {
                let (slot, when) = model.live(key);
                let expected = match (&slot, force) {
                    (Slot::Absent, _) => Forgotten::Nothing,
                    (Slot::Claimed { .. }, false) => Forgotten::InFlight,
                    (Slot::Claimed { .. }, true) => Forgotten::ForcedInFlight,
                    (Slot::Completed { .. }, _) => Forgotten::Completed,
                };
                let got = match store.forget(&keys[key], force).await {
                    Ok(got) => got,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                if got != expected && !(when == When::Around && got == Forgotten::Nothing) {
                    return diverged(&format!("{expected:?}"), format!("{got:?}"));
                }
                // Nothing forgotten leaves what lapsed or expired there: a
                // lapsed claim is still taken over.
                if !matches!(got, Forgotten::InFlight | Forgotten::Nothing) {
                    model.slots[key] = Slot::Absent;
                }
            }
            Step::Inspect { key } => {
                let (slot, when) = model.live(key);
                let got = match store.inspect(&keys[key]).await {
                    Ok(got) => got,
                    Err(error) => return diverged("an answer", format!("an error ({error})")),
                };
                let matches = match (&slot, &got) {
                    (Slot::Absent, KeyState::Absent)
                    | (Slot::Claimed { .. }, KeyState::InFlight { .. }) => true,
                    (Slot::Completed { record, .. }, KeyState::Completed { record: got, .. }) => {
                        **got == *records[*record]
                    }
                    (_, KeyState::Absent) => when == When::Around,
                    _ => false,
                };
                if !matches {
                    return diverged(&format!("{slot:?}"), format!("{got:?}"));
                }
            }
        }
    }
    None
}

/// A claim's answer by name, for what the model allows and what a rule
/// reports.
pub(super) fn claim_name<G>(claim: &Claim<G>) -> &'static str {
    match claim {
        Claim::Acquired(_) => "Acquired",
        Claim::TakenOver { .. } => "TakenOver",
        Claim::InFlight { .. } => "InFlight",
        Claim::Mismatch => "Mismatch",
        Claim::Completed { .. } => "Completed",
    }
}

/// The `n`-th record of a sequence: each one of its own.
fn record(n: usize) -> CompletedRecord {
    CompletedRecord::Message {
        result: Some(Bytes::from(format!("{{\"record\":{n}}}"))),
        created_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    }
}

/// Runs `cases` random sequences of `len` steps against fresh stores; the
/// first that diverges, shrunk to the fewest steps that still diverge, as
/// a report.
pub(super) async fn check<M, Fut, St>(
    make: &M,
    seed: u64,
    cases: usize,
    len: usize,
    unit: Duration,
    inspect: bool,
) -> Result<(), String>
where
    M: Fn() -> Fut,
    Fut: Future<Output = St>,
    St: Store<Granted = LeaseToken>,
{
    for case in 0..cases {
        let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(case as u64));
        let mut steps = sequence(&mut rng, len, inspect);
        if run(&make().await, &steps, unit).await.is_none() {
            continue;
        }
        // Shrink: drop one step at a time while the rest still diverges.
        let mut shrunk = true;
        while shrunk {
            shrunk = false;
            for i in (0..steps.len()).rev() {
                let mut fewer = steps.clone();
                fewer.remove(i);
                if run(&make().await, &fewer, unit).await.is_some() {
                    steps = fewer;
                    shrunk = true;
                }
            }
        }
        let Some(divergence) = run(&make().await, &steps, unit).await else {
            // It diverged, then not: the store is not deterministic here.
            return Err(format!(
                "a sequence diverged, then did not when run again (seed {seed}, case {case})"
            ));
        };
        let listed: Vec<String> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| format!("  {}{s}", if i == divergence.at { "→ " } else { "  " }))
            .collect();
        return Err(format!(
            "the store diverged from the model (seed {seed}, case {case}) at step {}: expected {}, got {}, in\n{}",
            divergence.at,
            divergence.expected,
            divergence.got,
            listed.join("\n")
        ));
    }
    Ok(())
}
