//! Command-line flags and how they combine with the fleet file (flags win).

use crate::spec::FleetSpec;
use std::path::PathBuf;

pub const USAGE: &str = "\
usage: kvroute-sim [--fleet FLEET.json] [--replicas N] [--base-port P] [--control-port P]
                   [--time-scale X] [--exit-on-stdin-eof]
       kvroute-sim tokenizer --out FILE   (writes the simulator's byte-level BPE tokenizer.json)

Starts N simulated vLLM replicas on 127.0.0.1, prints one JSON line with their URLs and
KV-event endpoints, then runs until SIGTERM/SIGINT (or stdin EOF with --exit-on-stdin-eof).
  --fleet FILE          fleet spec (JSON, every field optional; see sim/README.md)
  --replicas N          number of replicas (default 4)
  --base-port P         replica i listens on P+i; 0 (default) picks free ports
  --control-port P      control API port; 0 (default) picks a free port
  --time-scale X        real seconds per simulated second (default 1.0; 0.01 = 100x faster)
  --exit-on-stdin-eof   exit when standard input is closed (handy for parent processes)";

#[derive(Debug, Default, PartialEq)]
pub struct Cli {
    pub fleet: Option<PathBuf>,
    pub replicas: Option<usize>,
    pub base_port: u16,
    pub control_port: u16,
    pub time_scale: Option<f64>,
    pub exit_on_stdin_eof: bool,
    pub help: bool,
}

/// Parses flags; accepts both `--flag value` and `--flag=value`.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Cli, String> {
    let mut cli = Cli::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--fleet" => cli.fleet = Some(PathBuf::from(value("--fleet")?)),
            "--replicas" => cli.replicas = Some(number(&value("--replicas")?, "--replicas")?),
            "--base-port" => cli.base_port = number(&value("--base-port")?, "--base-port")?,
            "--control-port" => {
                cli.control_port = number(&value("--control-port")?, "--control-port")?
            }
            "--time-scale" => {
                cli.time_scale = Some(number(&value("--time-scale")?, "--time-scale")?)
            }
            "--exit-on-stdin-eof" => cli.exit_on_stdin_eof = true,
            "-h" | "--help" => cli.help = true,
            other => return Err(format!("unknown argument: {other}")),
        }
    }
    Ok(cli)
}

fn number<T: std::str::FromStr>(text: &str, flag: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{flag}: not a valid number: {text}"))
}

impl Cli {
    /// The fleet file (or defaults) with flags applied on top.
    pub fn spec(&self) -> Result<FleetSpec, String> {
        let mut spec = match &self.fleet {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                FleetSpec::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => FleetSpec::default(),
        };
        if let Some(n) = self.replicas {
            spec.replicas = n;
        }
        if let Some(x) = self.time_scale {
            spec.time_scale = x;
        }
        spec.validate()?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_every_flag_in_both_forms() {
        let cli = parse(args("--replicas 3 --base-port=9000 --control-port 9100 --time-scale 0.01 --exit-on-stdin-eof")).unwrap();
        assert_eq!(cli.replicas, Some(3));
        assert_eq!((cli.base_port, cli.control_port), (9000, 9100));
        assert_eq!(cli.time_scale, Some(0.01));
        assert!(cli.exit_on_stdin_eof);
    }

    #[test]
    fn flags_override_the_fleet_file() {
        let path =
            std::env::temp_dir().join(format!("kvroute-sim-cli-{}.json", std::process::id()));
        std::fs::write(
            &path,
            r#"{"replicas": 8, "time_scale": 0.5, "max_num_seqs": 2}"#,
        )
        .unwrap();
        let cli = Cli {
            fleet: Some(path.clone()),
            replicas: Some(2),
            ..Cli::default()
        };
        let spec = cli.spec().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            (spec.replicas, spec.time_scale, spec.max_num_seqs),
            (2, 0.5, 2)
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(parse(args("--replicas")).is_err());
        assert!(parse(args("--replicas two")).is_err());
        assert!(parse(args("--bogus")).is_err());
        let cli = Cli {
            replicas: Some(0),
            ..Cli::default()
        };
        assert!(cli.spec().is_err());
    }
}
