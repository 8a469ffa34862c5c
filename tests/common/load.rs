//! Streamed chat load for the failover tests: clients that send chat completions through Envoy
//! until stopped, and a tally of what came back (which backend served which group, what failed).

use super::{chat_body, client, debug_config, system_prompt, Fleet};
use kvroute_harness::backend::STREAM_CHUNKS;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// What the clients saw.
#[derive(Default)]
pub struct Tally {
    pub ok: AtomicU64,
    pub failures: Mutex<Vec<String>>,
    /// `(group, backend)` of every successful request of a shared group, in completion order.
    pub served: Mutex<Vec<(usize, usize)>>,
}

/// Clients streaming chat requests of `groups` shared groups (and now and then a new prefix).
pub struct Load {
    pub tally: Arc<Tally>,
    done: Arc<AtomicBool>,
    clients: Vec<JoinHandle<()>>,
    /// Held by a load from `fleet_under_load` for its whole life: such loads run one at a time.
    _exclusive: Option<tokio::sync::MutexGuard<'static, ()>>,
}

/// Each load from `fleet_under_load` loads the machine: one at a time.
static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Load {
    /// Starts `clients` clients posting to `url` (Envoy's `/v1/chat/completions`).
    pub fn start(url: String, clients: usize, groups: usize) -> Load {
        let tally = Arc::new(Tally::default());
        let done = Arc::new(AtomicBool::new(false));
        let clients = (0..clients)
            .map(|c| {
                let (tally, done, url) = (tally.clone(), done.clone(), url.clone());
                tokio::spawn(async move {
                    let client = client();
                    let mut i = 0;
                    while !done.load(Ordering::Relaxed) {
                        // Mostly the shared groups, sometimes a new prefix, which kvroute places
                        // anew.
                        let group = if i % 4 == 3 {
                            1000 + c * 10_000 + i
                        } else {
                            (c + i) % groups
                        };
                        let body = chat_body(&system_prompt(group), &format!("q {c}-{i}"), true);
                        match stream_once(&client, &url, body.to_string()).await {
                            Ok(backend) => {
                                tally.ok.fetch_add(1, Ordering::Relaxed);
                                if group < groups {
                                    tally.served.lock().unwrap().push((group, backend));
                                }
                            }
                            Err(e) => tally.failures.lock().unwrap().push(e),
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        Load {
            tally,
            done,
            clients,
            _exclusive: None,
        }
    }

    /// Requests answered in full so far.
    pub fn ok(&self) -> u64 {
        self.tally.ok.load(Ordering::Relaxed)
    }

    /// How many shared-group requests were served so far: a mark for [`Load::served_since`].
    pub fn served_len(&self) -> usize {
        self.tally.served.lock().unwrap().len()
    }

    /// `(group, backend)` of the shared-group requests served after mark `from`.
    pub fn served_since(&self, from: usize) -> Vec<(usize, usize)> {
        let served = self.tally.served.lock().unwrap();
        served.get(from..).unwrap_or_default().to_vec()
    }

    /// Stops the clients once their requests in flight end: requests answered in full, and what
    /// was wrong with the others.
    pub async fn stop(self) -> (u64, Vec<String>) {
        self.done.store(true, Ordering::Relaxed);
        for c in self.clients {
            c.await.expect("client task");
        }
        let failures = self.tally.failures.lock().unwrap().clone();
        (self.tally.ok.load(Ordering::Relaxed), failures)
    }
}

/// Four backends behind kvroute (`debug_config`, health-checked every `health_check`), each
/// taking 20 ms to answer so that streams overlap a failure as they would on a real engine, under
/// `clients` clients streaming `groups` groups' requests; returns once backend `victim` has served
/// some of them, a shared group's among them.
pub async fn fleet_under_load(
    health_check: Duration,
    clients: usize,
    groups: usize,
    victim: usize,
) -> (Arc<Fleet>, Load) {
    let exclusive = EXCLUSIVE.lock().await;
    let fleet = Arc::new(
        Fleet::kvroute(4, debug_config(), |o| {
            o.health_check_interval = Some(health_check)
        })
        .await,
    );
    for b in &fleet.backends {
        b.set_delay(Duration::from_millis(20));
    }
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    let mut load = Load::start(url, clients, groups);
    load._exclusive = Some(exclusive);
    let backend = &fleet.backends[victim];
    wait_until(
        "the victim serves a shared group",
        Duration::from_secs(60),
        || backend.completed() >= 20 && load.served_since(0).iter().any(|&(_, b)| b == victim),
    )
    .await;
    (fleet, load)
}

/// One streamed chat request: the backend that served it; `Err` says what was wrong with the
/// answer.
pub async fn stream_once(
    client: &reqwest::Client,
    url: &str,
    body: String,
) -> Result<usize, String> {
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status().as_u16();
    let backend = resp
        .headers()
        .get("x-backend")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let text = resp.text().await.map_err(|e| format!("body: {e}"))?;
    let events = text.matches("data: {").count();
    if status != 200 || events != STREAM_CHUNKS || !text.contains("data: [DONE]") {
        return Err(format!("status {status}, {events} events: {text:.200}"));
    }
    backend.ok_or_else(|| "no x-backend header".to_string())
}

/// Fails the test, with a few of the failures and Envoy's log, unless none of the requests
/// failed (`ok` of them were answered in full).
pub fn assert_none_failed(fleet: &Fleet, ok: u64, failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} of {} requests failed, e.g. {:?}\n{}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(5)],
        fleet.envoy.log_tail()
    );
}

/// Waits until `ok` holds, or fails after `timeout` saying `what`.
pub async fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
