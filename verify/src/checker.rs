//! The checker: decides, per key, from the history and the effects alone,
//! whether anything ran twice, was lost, answered inconsistently, executed
//! under a reused key, crossed tenants, or stayed stuck.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
};

use crate::history::{Effect, Event, FaultWindow};

/// What a key must never come to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Violation {
    /// More than one effect for one key: executed twice.
    Duplicated { key: String, effects: usize },
    /// A 2xx answered, yet no effect: the answer promised a charge that is
    /// not there.
    Lost { key: String },
    /// Two 2xx answers for one key named different charges, or an answer
    /// named a charge the ledger does not hold for the key.
    Inconsistent { key: String, detail: String },
    /// The key reused with other parameters executed.
    MismatchExecuted { key: String },
    /// An answer carried another tenant's charge.
    CrossTenant {
        key: String,
        account: String,
        charged: String,
    },
    /// After the faults healed, the key never answered with its charge.
    Stuck { key: String, last: String },
    /// An effect no operation asked for.
    Unexplained { key: String },
}

impl Violation {
    pub fn key(&self) -> &str {
        match self {
            Self::Duplicated { key, .. }
            | Self::Lost { key }
            | Self::Inconsistent { key, .. }
            | Self::MismatchExecuted { key }
            | Self::CrossTenant { key, .. }
            | Self::Stuck { key, .. }
            | Self::Unexplained { key } => key,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Duplicated { .. } => "duplicated",
            Self::Lost { .. } => "lost",
            Self::Inconsistent { .. } => "inconsistent",
            Self::MismatchExecuted { .. } => "mismatch-executed",
            Self::CrossTenant { .. } => "cross-tenant",
            Self::Stuck { .. } => "stuck",
            Self::Unexplained { .. } => "unexplained",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Duplicated { key, effects } => write!(f, "{key}: executed {effects} times"),
            Self::Lost { key } => write!(f, "{key}: answered 2xx, no effect"),
            Self::Inconsistent { key, detail } => write!(f, "{key}: {detail}"),
            Self::MismatchExecuted { key } => {
                write!(f, "{key}: reused with other parameters, and executed")
            }
            Self::CrossTenant {
                key,
                account,
                charged,
            } => write!(f, "{key}: {account} was answered with {charged}'s charge"),
            Self::Stuck { key, last } => write!(f, "{key}: no charge after the heal ({last})"),
            Self::Unexplained { key } => write!(f, "{key}: an effect no operation asked for"),
        }
    }
}

/// The figures of a run, Jepsen-style, and what went wrong.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub ops: usize,
    pub attempts: usize,
    pub faults: BTreeMap<String, usize>,
    /// Operations that end with exactly one effect, answered consistently.
    pub ok: usize,
    /// Of those, the ones a client did not hear about during the faults:
    /// no answer, or a refusal to retry later, then the charge after the
    /// heal.
    pub recovered: usize,
    pub lost: usize,
    pub duplicated: usize,
    pub stuck: usize,
    pub violations: Vec<Violation>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "ops        {}", self.ops)?;
        writeln!(f, "attempts   {}", self.attempts)?;
        let faults: usize = self.faults.values().sum();
        let by_kind: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        writeln!(f, "faults     {faults} ({})", by_kind.join(", "))?;
        writeln!(f, "ok         {}", self.ok)?;
        writeln!(f, "recovered  {}", self.recovered)?;
        writeln!(f, "lost       {}", self.lost)?;
        writeln!(f, "duplicated {}", self.duplicated)?;
        writeln!(f, "stuck      {}", self.stuck)?;
        writeln!(f, "violations {}", self.violations.len())
    }
}

/// Checks a history against the effects the ledger holds.
pub fn check(events: &[Event], effects: &[Effect], faults: &[FaultWindow]) -> Report {
    let mut report = Report::default();
    for fault in faults {
        *report.faults.entry(fault.kind.clone()).or_default() += 1;
    }
    // A key is the tenant's: the same key under two accounts is two
    // operations.
    let mut by_key: BTreeMap<String, Vec<&Event>> = BTreeMap::new();
    for event in events {
        by_key
            .entry(tenant_key(&event.account, &event.key))
            .or_default()
            .push(event);
    }
    let mut effects_by_key: HashMap<String, Vec<&Effect>> = HashMap::new();
    for effect in effects {
        effects_by_key
            .entry(tenant_key(&effect.account, &effect.key))
            .or_default()
            .push(effect);
    }
    report.attempts = events
        .iter()
        .filter(|e| e.is_completion())
        .map(|e| e.attempts.max(1) as usize)
        .sum();

    for (key, events) in &by_key {
        let Some(invoke) = events
            .iter()
            .find(|e| e.kind == "invoke" && e.via == "client")
        else {
            continue;
        };
        report.ops += 1;
        let found = effects_by_key.remove(key).unwrap_or_default();
        let key = key.as_str();
        let before = report.violations.len();
        check_key(key, invoke, events, &found, &mut report);
        if report.violations.len() == before {
            report.ok += 1;
            let heard = events.iter().any(|e| e.via == "client" && e.kind == "ok");
            if !heard {
                report.recovered += 1;
            }
        }
    }
    for (key, _) in effects_by_key {
        report.violations.push(Violation::Unexplained { key });
    }
    report.violations.sort();
    report
}

fn check_key(key: &str, invoke: &Event, events: &[&Event], found: &[&Effect], report: &mut Report) {
    let violation = |v: Violation| v;
    let mut violations = Vec::new();
    let executions: Vec<&&Effect> = found.iter().filter(|e| e.amount == invoke.amount).collect();
    if found.len() > 1 {
        report.duplicated += 1;
        violations.push(violation(Violation::Duplicated {
            key: key.into(),
            effects: found.len(),
        }));
    }
    if found.iter().any(|e| e.amount != invoke.amount)
        || events.iter().any(|e| e.via == "mismatch" && e.kind == "ok")
    {
        violations.push(Violation::MismatchExecuted { key: key.into() });
    }
    let answered: Vec<&&Event> = events
        .iter()
        .filter(|e| e.kind == "ok" && e.via != "mismatch")
        .collect();
    for answer in &answered {
        if let Some(charged) = &answer.charge_account
            && charged != &answer.account
        {
            violations.push(Violation::CrossTenant {
                key: key.into(),
                account: answer.account.clone(),
                charged: charged.clone(),
            });
        }
    }
    if !answered.is_empty() && found.is_empty() {
        report.lost += 1;
        violations.push(Violation::Lost { key: key.into() });
    }
    let charges: Vec<&str> = answered
        .iter()
        .filter_map(|e| e.charge.as_deref())
        .collect();
    if let Some(first) = charges.first() {
        if charges.iter().any(|c| c != first) {
            violations.push(Violation::Inconsistent {
                key: key.into(),
                detail: format!("answers name different charges: {charges:?}"),
            });
        } else if !executions.is_empty() && !executions.iter().any(|e| e.id == *first) {
            violations.push(Violation::Inconsistent {
                key: key.into(),
                detail: format!("answered with {first}, which the ledger does not hold for it"),
            });
        }
    }
    let last = events
        .iter()
        .rev()
        .find(|e| e.via == "final" && e.kind != "invoke");
    let healed = last.is_some_and(|e| e.kind == "ok");
    if !healed {
        report.stuck += 1;
        violations.push(Violation::Stuck {
            key: key.into(),
            last: last.map_or("no final answer".into(), |e| {
                format!("{} {:?}", e.kind, e.status)
            }),
        });
    }
    report.violations.extend(violations);
}

/// How a key is named in a report: `account/key`.
pub fn tenant_key(account: &str, key: &str) -> String {
    format!("{account}/{key}")
}

/// The events of the keys that went wrong, to print with a failure.
pub fn slices<'a>(events: &'a [Event], report: &Report) -> BTreeMap<String, Vec<&'a Event>> {
    let mut slices: BTreeMap<String, Vec<&Event>> = BTreeMap::new();
    for violation in report.violations.iter().take(10) {
        slices.insert(
            violation.key().to_owned(),
            events
                .iter()
                .filter(|e| tenant_key(&e.account, &e.key) == violation.key())
                .collect(),
        );
    }
    slices
}
