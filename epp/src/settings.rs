//! The command line, and the gateway configuration it resolves to: the filter's JSON config, with
//! the endpoints and the servers the gateway polls placed where its calls reach them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use kvroute::config::Config;
use kvroute_indexer::config::Events;
use kvroute_indexer::state::Shared as Index;

use crate::extproc::{Options, DESTINATION_KEY};
use crate::pool_watch::Source;
use crate::upstreams::{Pool, Target, Upstreams};

/// The filter's configuration as `envoy/kvroute.yaml` ships it: the picker's when `--config` is
/// not given (the cluster names are the ones the picker answers for).
pub const DEFAULT_CONFIG: &str = r#"{
  "policy": "cache_aware",
  "clusters": ["inference_pool"],
  "admin_cluster": "kvroute_admin",
  "engine_metrics_cluster": "inference_pool",
  "stats_interval_ms": 500
}"#;

/// kvroute as a Gateway API Inference Extension endpoint picker: Envoy's ext_proc protocol over
/// gRPC, picking with the same routing core as the kvroute filter.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvroute-epp", version)]
// The indexer requires these two; here they are asked for only with the rest of its flags.
#[command(mut_arg("tokenizer", |a| a.required(false)), mut_arg("model", |a| a.required(false)))]
pub struct Args {
    /// Address of the gRPC server (ext_proc and health).
    #[arg(long, default_value = "127.0.0.1:9002")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` listener; none when not given.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// The kvroute filter's JSON configuration (the same fields; README "Configuration").
    /// Default: the one envoy/kvroute.yaml ships.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The endpoints to pick from, `ip:port` comma-separated: shown to the gateway as the hosts
    /// of its routed cluster (`--pool`), all healthy, from its admin cluster.
    #[arg(long, value_delimiter = ',')]
    pub endpoints: Vec<SocketAddr>,
    /// Instead of `--endpoints`: an Envoy admin (`ip:port`) the gateway polls for the pool, its
    /// health checks and active requests, as the filter does.
    #[arg(long)]
    pub envoy_admin: Option<SocketAddr>,
    /// Instead of `--endpoints`: the InferencePool (`inference.networking.k8s.io/v1`) whose
    /// ready pods, at its target ports, are the endpoints; watched through the Kubernetes API.
    #[arg(long)]
    pub inference_pool: Option<String>,
    /// The InferencePool's namespace. Default: the pod's own (its service account's), else
    /// `default`.
    #[arg(long, requires = "inference_pool")]
    pub namespace: Option<String>,
    /// The name of the pool's cluster, the one every request is routed in.
    #[arg(long, default_value = "inference_pool")]
    pub pool: String,
    /// kvroute-indexer (`ip:port`), for a config with `index_cluster` (precise mode).
    #[arg(long)]
    pub indexer: Option<SocketAddr>,
    /// Worker threads, each with its own gateway (as Envoy's workers each have a filter VM).
    /// Default: the machine's cores.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Name only the pick, without fallbacks (for gateways that read one address).
    #[arg(long)]
    pub single_address: bool,
    /// Also take the subset from the request header `x-gateway-destination-endpoint-subset`; the
    /// gateway must set it and keep clients from sending it.
    #[arg(long)]
    pub subset_from_header: bool,
    /// Instead of `--indexer`, precise mode in this process: the engines' KV events followed and
    /// keyed as kvroute-indexer does it, with its flags (`--engine`, `--tokenizer`, `--model`,
    /// ...); the key chunk is the config's `chunk_size`.
    #[command(
        flatten,
        next_help_heading = "Precise mode in process (kvroute-indexer's flags)"
    )]
    pub events: Option<Events>,
}

/// What the picker runs with, once the command line and the config agree.
pub struct Settings {
    pub args: Args,
    pub config: Config,
    pub upstreams: Upstreams,
    pub pool: Option<Arc<Pool>>,
    /// The InferencePool the pool's members come from, with `--inference-pool`.
    pub inference_pool: Option<Source>,
    /// Precise mode's index, kept in process, and the engines whose events fill it.
    pub index: Option<(Arc<Index>, Events)>,
    pub options: Options,
}

impl Settings {
    /// Reads the config file and checks it against the command line; the error names the field
    /// or flag at fault.
    pub fn resolve(args: Args) -> Result<Settings, String> {
        let (bytes, source) = match &args.config {
            Some(path) => {
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("cannot read --config {}: {e}", path.display()))?;
                (bytes, path.display().to_string())
            }
            None => (
                DEFAULT_CONFIG.as_bytes().to_vec(),
                "the default config".to_string(),
            ),
        };
        let config = Config::parse(&bytes).map_err(|e| format!("{source}: {e}"))?;
        Settings::with_config(args, config)
    }

    pub fn with_config(args: Args, config: Config) -> Result<Settings, String> {
        let mut upstreams = Upstreams::new(&config.header);
        let mut pool = None;
        let given: Vec<&str> = [
            ("--endpoints", !args.endpoints.is_empty()),
            ("--envoy-admin", args.envoy_admin.is_some()),
            ("--inference-pool", args.inference_pool.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        if given.len() > 1 {
            return Err(format!(
                "give one of --endpoints, --envoy-admin and --inference-pool, not {}",
                given.join(" and ")
            ));
        }
        let listing = given.iter().find(|flag| **flag != "--envoy-admin");
        if let (Some(flag), false) = (listing, config.endpoints.is_empty()) {
            return Err(format!(
                "{flag} and the config's `endpoints` both list endpoints: keep one"
            ));
        }
        let inference_pool = args
            .inference_pool
            .as_deref()
            .map(|name| Source::new(name, args.namespace.as_deref()));
        if let Some(admin) = &config.admin_cluster {
            let target = if let Some(addr) = &args.envoy_admin {
                Target::Fixed(addr.to_string())
            } else if !args.endpoints.is_empty() || inference_pool.is_some() {
                let p = Arc::new(match inference_pool {
                    Some(_) => Pool::unlisted(&args.pool),
                    None => Pool::new(&args.pool, args.endpoints.clone()),
                });
                pool = Some(p.clone());
                Target::Pool(p)
            } else if !config.endpoints.is_empty() {
                Target::Pool(Arc::new(Pool::new(&args.pool, Vec::new())))
            } else {
                return Err(format!(
                    "the config's `admin_cluster` ({admin}) needs --endpoints, --envoy-admin or --inference-pool"
                ));
            };
            upstreams = upstreams.with(admin, target);
        } else if let Some(flag) = given.first() {
            return Err(format!("{flag} needs the config's `admin_cluster`"));
        }
        if let Some(engines) = &config.engine_metrics_cluster {
            upstreams = upstreams.with(engines, Target::Named);
        }
        let mut index = None;
        match (&config.index_cluster, args.indexer, &args.events) {
            (Some(_), Some(_), Some(_)) => {
                return Err("give --indexer or --engine (precise mode in process), not both".into())
            }
            (Some(cluster), Some(addr), None) => {
                upstreams = upstreams.with(cluster, Target::Fixed(addr.to_string()));
            }
            (Some(cluster), None, Some(events)) => {
                let shared = kvroute_indexer::index(events, config.chunk_size)?;
                upstreams = upstreams.with(cluster, Target::Index(shared.clone()));
                index = Some((shared, events.clone()));
            }
            (Some(cluster), None, None) => {
                return Err(format!(
                    "the config's `index_cluster` ({cluster}) needs --indexer or --engine"
                ))
            }
            (None, Some(_), _) => return Err("--indexer needs the config's `index_cluster`".into()),
            (None, None, Some(_)) => {
                return Err("--engine needs the config's `index_cluster` (precise mode)".into())
            }
            (None, None, None) => {}
        }
        let options = Options {
            header: config.header.clone(),
            single_address: args.single_address,
            subset_from_header: args.subset_from_header,
        };
        if config.header != DESTINATION_KEY {
            log::warn!(
                "the routing header is {} (config `header`); the endpoint picker protocol's is {DESTINATION_KEY}",
                config.header
            );
        }
        Ok(Settings {
            args,
            config,
            upstreams,
            pool,
            inference_pool,
            index,
            options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(flags: &[&str]) -> Result<Settings, String> {
        let args = Args::parse_from([&["kvroute-epp"], flags].concat());
        Settings::resolve(args)
    }

    #[test]
    fn one_source_of_endpoints_is_given() {
        let pool = ["--inference-pool", "p"];
        for other in [
            &["--endpoints", "127.0.0.1:8001"][..],
            &["--envoy-admin", "127.0.0.1:9901"],
        ] {
            let Err(error) = resolve(&[&pool[..], other].concat()) else {
                panic!("{other:?} with --inference-pool was taken");
            };
            assert!(
                error.contains("--inference-pool") && error.contains(other[0]),
                "{error}"
            );
        }
        let Err(error) = resolve(&[]) else {
            panic!("no endpoints was taken");
        };
        assert!(error.contains("--inference-pool"), "{error}");
    }

    #[test]
    fn an_inference_pool_starts_unlisted_in_the_namespace_given() {
        let settings = resolve(&["--inference-pool", "p", "--namespace", "models"]).unwrap();
        let source = settings.inference_pool.unwrap();
        assert_eq!(
            (source.namespace.as_str(), source.name.as_str()),
            ("models", "p")
        );
        assert!(!settings.pool.unwrap().listed());
        assert!(Args::try_parse_from(["kvroute-epp", "--namespace", "models"]).is_err());
    }

    #[test]
    fn precise_mode_takes_an_indexer_or_engines_and_needs_the_index_cluster() {
        let with = |flags: &[&str], index_cluster: bool| {
            let endpoints = ["kvroute-epp", "--endpoints", "127.0.0.1:8001"];
            let args = Args::parse_from([&endpoints[..], flags].concat());
            let mut config: serde_json::Value = serde_json::from_str(DEFAULT_CONFIG).unwrap();
            if index_cluster {
                config["index_cluster"] = "kvroute_indexer".into();
            }
            let config = Config::parse(config.to_string().as_bytes()).unwrap();
            match Settings::with_config(args, config) {
                Ok(_) => String::from("taken"),
                Err(e) => e,
            }
        };
        let engine = [
            "--engine",
            "127.0.0.1:8001=tcp://127.0.0.1:5557",
            "--model",
            "m",
            "--tokenizer",
            "no-such-tokenizer.json",
        ];
        let indexer = ["--indexer", "127.0.0.1:9400"];
        let error = with(&engine, false);
        assert!(
            error.contains("--engine") && error.contains("index_cluster"),
            "{error}"
        );
        let error = with(&indexer, false);
        assert!(
            error.contains("--indexer") && error.contains("index_cluster"),
            "{error}"
        );
        let error = with(&[], true);
        assert!(error.contains("--indexer or --engine"), "{error}");
        let error = with(&[&engine[..], &indexer].concat(), true);
        assert!(error.contains("not both"), "{error}");
        // The index is made at load: a tokenizer it cannot read stops it, named.
        let error = with(&engine, true);
        assert!(error.contains("no-such-tokenizer.json"), "{error}");
        assert_eq!(with(&indexer, true), "taken");
    }
}
