//! The command line, and the gateway configuration it resolves to: the filter's JSON config, with
//! the endpoints and the servers the gateway polls placed where its calls reach them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use kvroute::config::Config;

use crate::extproc::{Options, DESTINATION_KEY};
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
}

/// What the picker runs with, once the command line and the config agree.
pub struct Settings {
    pub args: Args,
    pub config: Config,
    pub upstreams: Upstreams,
    pub pool: Option<Arc<Pool>>,
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
        if !args.endpoints.is_empty() && !config.endpoints.is_empty() {
            return Err(
                "--endpoints and the config's `endpoints` both list endpoints: keep one".into(),
            );
        }
        if let Some(admin) = &config.admin_cluster {
            let target = match (&args.envoy_admin, args.endpoints.is_empty()) {
                (Some(_), false) => {
                    return Err("give --endpoints or --envoy-admin, not both".into())
                }
                (Some(addr), true) => Target::Fixed(addr.to_string()),
                (None, false) => {
                    let p = Arc::new(Pool::new(&args.pool, args.endpoints.clone()));
                    pool = Some(p.clone());
                    Target::Pool(p)
                }
                (None, true) if !config.endpoints.is_empty() => {
                    Target::Pool(Arc::new(Pool::new(&args.pool, Vec::new())))
                }
                (None, true) => {
                    return Err(format!(
                        "the config's `admin_cluster` ({admin}) needs --endpoints or --envoy-admin"
                    ))
                }
            };
            upstreams = upstreams.with(admin, target);
        } else if !args.endpoints.is_empty() || args.envoy_admin.is_some() {
            return Err("--endpoints and --envoy-admin need the config's `admin_cluster`".into());
        }
        if let Some(engines) = &config.engine_metrics_cluster {
            upstreams = upstreams.with(engines, Target::Named);
        }
        if let Some(index) = &config.index_cluster {
            let addr = args
                .indexer
                .ok_or_else(|| format!("the config's `index_cluster` ({index}) needs --indexer"))?;
            upstreams = upstreams.with(index, Target::Fixed(addr.to_string()));
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
            options,
        })
    }
}
