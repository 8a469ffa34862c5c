//! kvroute-epp: parses the command line and the config, then serves until SIGINT/SIGTERM.

use std::process::ExitCode;

use clap::Parser;
use kvroute_epp::settings::{Args, Settings};

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let settings = match Settings::resolve(Args::parse()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("kvroute-epp: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-epp: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let running = match kvroute_epp::start(settings).await {
            Ok(running) => running,
            Err(e) => {
                eprintln!("kvroute-epp: {e}");
                return ExitCode::from(2);
            }
        };
        eprintln!("kvroute-epp: ext_proc on {}", running.addr);
        if let Some(at) = running.metrics_addr {
            eprintln!("kvroute-epp: metrics on http://{at}/metrics");
        }
        stopped().await;
        ExitCode::SUCCESS
    })
}

async fn stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
