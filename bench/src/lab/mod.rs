// Until the lab's driver calls them, nothing in these modules is used by the binary.
#[allow(dead_code)]
pub mod smg;
#[allow(dead_code)]
pub mod stats;
