//! kvroute-epp: reads the command line and the config, then serves until SIGINT or SIGTERM.

use std::process::ExitCode;

use clap::Parser;
use kvroute_epp::settings::{Args, Settings};
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let started = match Settings::resolve(Args::parse()) {
        Ok(settings) => kvroute_epp::start(settings).await,
        Err(e) => Err(e),
    };
    let running = match started {
        Ok(running) => running,
        Err(e) => {
            eprintln!("kvroute-epp: {e}");
            return ExitCode::from(2);
        }
    };
    log::info!("ext_proc and gRPC health on {}", running.addr);
    if let Some(at) = running.metrics_addr {
        log::info!("stats on http://{at}/metrics");
    }
    // Kubernetes stops a pod with SIGTERM; a terminal with SIGINT.
    let Ok(mut terminate) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return ExitCode::SUCCESS;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    ExitCode::SUCCESS
}
