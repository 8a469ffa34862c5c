//! kvroute-sim: serves a simulated fleet of vLLM replicas until told to stop.

use kvroute_sim::cli::{self, USAGE};
use kvroute_sim::fleet::Fleet;
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("tokenizer") {
        return write_tokenizer(&args[1..]);
    }
    let cli = match cli::parse(args) {
        Ok(cli) => cli,
        Err(e) => {
            eprintln!("kvroute-sim: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if cli.help {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let spec = match cli.spec() {
        Ok(spec) => spec,
        Err(e) => {
            eprintln!("kvroute-sim: {e}");
            return ExitCode::from(2);
        }
    };
    // Two workers: the simulator sleeps most of the time and must leave CPU to the router.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-sim: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let fleet = match Fleet::start(spec, cli.base_port, cli.control_port).await {
            Ok(fleet) => fleet,
            Err(e) => {
                eprintln!("kvroute-sim: cannot start fleet: {e}");
                return ExitCode::FAILURE;
            }
        };
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", fleet.announcement());
        let _ = stdout.flush();
        drop(stdout);
        eprintln!(
            "kvroute-sim: {} replicas of {} ready (time_scale {})",
            fleet.replicas.len(),
            fleet.spec.model,
            fleet.spec.time_scale
        );
        wait_for_shutdown(cli.exit_on_stdin_eof).await;
        eprintln!("kvroute-sim: shutting down");
        ExitCode::SUCCESS
    })
}

async fn wait_for_shutdown(exit_on_stdin_eof: bool) {
    let (eof_tx, eof_rx) = tokio::sync::oneshot::channel::<()>();
    if exit_on_stdin_eof {
        // A plain thread: tokio's stdin would need another feature for one blocking read.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            let _ = eof_tx.send(());
        });
    }
    let stdin_eof = async {
        if exit_on_stdin_eof {
            let _ = eof_rx.await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let sigterm = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                eprintln!("kvroute-sim: cannot watch SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm => {}
        _ = stdin_eof => {}
    }
}

/// `kvroute-sim tokenizer --out FILE`: writes the simulator's trained tokenizer.json.
fn write_tokenizer(args: &[String]) -> ExitCode {
    let out = match args {
        [flag, path] if flag == "--out" => path,
        [flag] if flag.starts_with("--out=") => &flag["--out=".len()..],
        _ => {
            eprintln!("usage: kvroute-sim tokenizer --out FILE");
            return ExitCode::from(2);
        }
    };
    match kvroute_sim::bpe::write(std::path::Path::new(out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
