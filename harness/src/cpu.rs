//! CPU time, read from `/proc` (Linux; 0 elsewhere): what a benchmark
//! charges each process per operation, so that a ratio can be told apart
//! from what the machine's other processes did meanwhile.

/// User + system CPU time, in µs, of every process whose command is `name`,
/// with that of their exited children (the postmaster's reaped backends and
/// workers), so the sum only grows. A backend reaped while `/proc` is read
/// can be missed both as itself and in its parent's total (one run read
/// -467 µs per request that way), so the processes are read until two
/// readings in a row find the same ones.
pub fn processes_us(name: &str) -> f64 {
    let mut last = processes(name);
    loop {
        let next = processes(name);
        if next.0 == last.0 {
            return next.1;
        }
        last = next;
    }
}

/// User + system CPU time of this process so far, in µs; not its children
/// (a benchmark's `wrk` runs).
pub fn own_us() -> f64 {
    std::fs::read_to_string("/proc/self/stat").map_or(0.0, |stat| stat_us(&stat, false))
}

/// The ids of the processes whose command is `name`, and their CPU time
/// with their exited children's, in µs.
fn processes(name: &str) -> (Vec<u32>, f64) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (Vec::new(), 0.0);
    };
    let mut pids = Vec::new();
    let mut total = 0.0;
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let named = stat
            .split_once(" (")
            .is_some_and(|(_, rest)| rest.starts_with(&format!("{name})")));
        if named {
            pids.push(pid);
            total += stat_us(&stat, true);
        }
    }
    pids.sort_unstable();
    (pids, total)
}

/// User + system CPU time in a `/proc/<pid>/stat` line, in µs; with
/// `children`, plus that of the exited children it waited for.
fn stat_us(stat: &str, children: bool) -> f64 {
    // Fields after the command name, which is parenthesised and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks: f64 = fields
        .get(11..if children { 15 } else { 13 })
        .map_or(0.0, |t| {
            t.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
        });
    ticks * 1e6 / 100.0 // USER_HZ is 100 on Linux
}
