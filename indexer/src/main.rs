//! kvroute-indexer: parses the command line and runs the indexer until SIGINT/SIGTERM.

use clap::Parser;
use kvroute_indexer::config::Config;
use std::process::ExitCode;

/// Writes `info` and above to stderr, one line each.
struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            eprintln!("kvroute-indexer: {}: {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

fn main() -> ExitCode {
    let config = Config::parse();
    if log::set_logger(&Stderr).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-indexer: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let running = match kvroute_indexer::start(config).await {
            Ok(running) => running,
            Err(e) => {
                eprintln!("kvroute-indexer: {e}");
                return ExitCode::from(2);
            }
        };
        eprintln!("kvroute-indexer: listening on http://{}", running.addr);
        shutdown().await;
        ExitCode::SUCCESS
    })
}

async fn shutdown() {
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
