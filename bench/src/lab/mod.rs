//! The lab: the routing core driven against the simulator's engine model in virtual time.

// Nothing in the bench calls the lab yet.
#[allow(dead_code)]
pub mod index;
