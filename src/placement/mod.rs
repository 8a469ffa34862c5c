//! Where each group lives: a balanced assignment of the groups a gateway has seen to endpoints,
//! which every gateway that has seen the same groups computes alike.
//!
//! Rendezvous alone gives each group a home every gateway agrees on, but by chance: 24 groups on
//! 4 endpoints often put 9 on one and 3 on another, and under skewed traffic the hottest groups
//! may share one. Here the groups seen lately are kept in a shared-data table ([`table`]), which
//! each worker feeds with the requests it counts ([`tally`]); the fleet's request volume says
//! which share of the traffic this gateway sees ([`volume`]); each group weighs its popularity
//! relative to the mean ([`weights`]); each endpoint takes groups up to an even share of the
//! weight, each group as high in its rendezvous order as that allows ([`assign`]); where whole
//! groups cannot even the endpoints out, groups split, their conversations divided between homes
//! ([`split`]). The outcome depends only on the groups, their weights and the endpoints, not on
//! the order requests arrived in, so gateways that have seen the same traffic agree, and a
//! restarted gateway agrees again once it has seen it. Within a gateway one worker weighs the
//! groups and the others adopt its weights ([`leader`]); a group moves to a new home only once
//! the assignment has kept giving it that home for a while ([`homes`]).

mod assign;
pub mod homes;
pub mod leader;
mod split;
mod table;
mod tally;
#[cfg(test)]
mod tests;
mod volume;
mod weights;

pub use assign::assign;
pub use split::{home_of, shares, Shares, SHARE_UNITS};
pub use table::{read, record, Seen, HALF_LIFE_MS, PER_SHARD, SHARDS, TTL_MS};
pub use tally::{Tally, FLUSH_MS};
pub use volume::{own_volume, FleetVolume, MIN_FLEET_VOLUME, MIN_REQUESTS, MIN_SHARE};
pub use weights::{
    steady, weighted, EQUAL_BELOW_MEAN, EQUAL_SPREAD, MAX_WEIGHT, MEAN_WEIGHT, ONE_OFF_REPEATS,
};
