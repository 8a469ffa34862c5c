//! What the binaries' command lines share: running a command's future until it ends or a signal
//! stops it, the `--plugin-config` argument, and failing with a message.

use std::future::Future;

/// Runs `work` on a multi-threaded tokio runtime until it ends or SIGINT/SIGTERM stops it. On a
/// signal the future is dropped, and with it the Envoys, sims and peer routers it started (each
/// kills its process on drop): a bare exit would leave them running.
pub fn run_until_stopped(work: impl Future<Output = Result<(), String>>) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let outcome = rt.block_on(async {
        tokio::select! {
            outcome = work => outcome,
            signal = stop_signal() => Err(format!("stopped by {signal}")),
        }
    });
    // Tasks the run spawned hold processes too: end them before returning.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    outcome
}

/// The first SIGINT or SIGTERM, by name; never, where signals cannot be watched.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

/// `--plugin-config`: a JSON object laid over the shipped plugin config.
pub fn parse_plugin_config(text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("--plugin-config: {e}"))
}

/// Prints `msg` after the program's name and exits with status 1.
pub fn fail(program: &str, msg: String) -> ! {
    eprintln!("{program}: {msg}");
    std::process::exit(1)
}
