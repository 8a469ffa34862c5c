//! A process's CPU time so far, from `/proc` (Linux only): what the benchmarks charge a proxy or
//! router per request.

use std::time::Duration;

/// CPU time (user + system) process `pid` has used so far; `None` where `/proc` does not say.
pub fn time_of(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is parenthesised and may contain spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports these in clock ticks of 1/100 s (USER_HZ) on every common platform.
    Some(Duration::from_millis(ticks * 10))
}
