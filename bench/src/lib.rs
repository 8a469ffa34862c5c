//! kvroute-bench's library: workloads, the load driver, the routers and fleets a run starts, the
//! wall-clock comparison and the lab, their reports, and the analyses of a run's samples. The
//! binaries (`kvroute-bench`, `kvroute-overhead`) are command lines over it.

pub mod analyze;
pub mod cli;
pub mod compare;
pub mod demo;
pub mod driver;
pub mod epp;
pub mod keys;
pub mod kvroute_stats;
pub mod lab;
pub mod oracle;
pub mod paths;
pub mod peers;
pub mod precise;
pub mod real_fleet;
pub mod repeats;
pub mod report;
pub mod routers;
pub mod sim_process;
pub mod stamp;
pub mod stats;
pub mod targets;
pub mod workload;
