//! The plugin configuration: every field optional, defaults in one place, errors that name the field.

use std::net::SocketAddr;

use serde_json::{Map, Value};
use strum::{EnumString, VariantNames};

use crate::prefix::Shape;
use crate::request::ToolsAt;
use crate::template::Templates;

/// Which policy picks the endpoint (config `policy`, by its snake_case name). `CacheAware` is
/// kvroute's; the others are baselines to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, EnumString, VariantNames)]
#[strum(serialize_all = "snake_case")]
pub enum PolicyKind {
    CacheAware,
    RoundRobin,
    LeastRequest,
    Session,
    PrefixHash,
}

/// kvroute's configuration, read from the Wasm plugin's `configuration` (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Routing policy (`policy`).
    pub policy: PolicyKind,
    /// Request header that carries the chosen `ip:port` to Envoy's override_host LB (`header`).
    pub header: String,
    /// Bytes of prompt text per prefix chunk (`chunk_size`).
    pub chunk_size: usize,
    /// Chunks hashed per request at most; longer prompts are matched on their first part (`max_chunks`).
    pub max_chunks: usize,
    /// Bytes of a request's head (tools and system prompt, or first message) that key its group,
    /// at most (`group_bytes`). Groups that share a longer preamble share a home.
    pub group_bytes: usize,
    /// Fraction of a request's chunks an endpoint must hold for affinity to apply (`cache_threshold`).
    pub cache_threshold: f64,
    /// Requests above `balance_rel_threshold` × the fleet's mean load that make an endpoint
    /// overloaded (`balance_abs_threshold`). An engine that queues is overloaded regardless.
    pub balance_abs_threshold: u64,
    /// Multiple of the fleet's mean load an endpoint may carry, plus `balance_abs_threshold`,
    /// before its groups spill to their next endpoint (`balance_rel_threshold`).
    pub balance_rel_threshold: f64,
    /// How many bytes of uncached prompt an engine prefills per millisecond, until kvroute has
    /// learnt each endpoint's own rate from its first response bytes (`prefill_bytes_per_ms`).
    /// Weighs a cache hit against the prefill work queued ahead of it.
    pub prefill_bytes_per_ms: f64,
    /// Header whose value keys the `session` policy (`session_header`).
    pub session_header: String,
    /// Envoy cluster pointing at the admin interface, polled for `/clusters` (`admin_cluster`).
    pub admin_cluster: Option<String>,
    /// The clusters kvroute routes; the poll keeps only their hosts (all clusters if empty).
    /// Requests to any other cluster go to Envoy's load balancer untouched (`clusters`).
    pub clusters: Vec<String>,
    /// Cluster whose hosts' own metrics (requests running + waiting) are polled as load, through
    /// Envoy with the routing header naming each host (`engine_metrics_cluster`).
    pub engine_metrics_cluster: Option<String>,
    /// Path of the engines' Prometheus metrics (`engine_metrics_path`).
    pub engine_metrics_path: String,
    /// How often one worker polls the admin stats (`stats_interval_ms`).
    pub stats_interval_ms: u64,
    /// Static endpoints; when set they replace discovery from `/clusters` (`endpoints`).
    pub endpoints: Vec<String>,
    /// Largest request body kvroute buffers to route; larger ones go to the fallback (`max_body_bytes`).
    pub max_body_bytes: usize,
    /// Shared-data slots of the affinity map, each holding a few prefix records (`affinity_capacity`).
    pub affinity_capacity: u32,
    /// Add `x-kvroute-decision` to responses (`debug_header`).
    pub debug_header: bool,
    /// Extra endpoints listed after the chosen one, for Envoy retries (`fallback_endpoints`).
    pub fallback_endpoints: usize,
    /// For tests of Envoy's failure policy only, never in production: a request to exactly this
    /// path makes the filter trap (panic), failing its VM (`unsafe_trap_path_for_tests`). Unset
    /// by default, and then nothing a client sends can make kvroute trap on purpose.
    pub unsafe_trap_path_for_tests: Option<String>,
    /// Where the served model's chat template renders the tool list (`tools_position`).
    pub tools_position: ToolsAt,
    /// How old an affinity record must be before an engine's cached-token report may show it
    /// evicted; a younger prefix may still be prefilling (`eviction_grace_ms`). Set it above the
    /// fleet's p99 time to first token.
    pub eviction_grace_ms: u64,
    /// Envoy cluster of kvroute-indexer, which follows the engines' KV-cache events; set, kvroute
    /// prefers the endpoint whose engine holds the longest prefix of a request (`index_cluster`).
    pub index_cluster: Option<String>,
    /// Path of the indexer's change feed (`index_path`).
    pub index_path: String,
    /// Shared-data slots of the engine index, each holding a few keys (`engine_index_capacity`).
    /// Size it to the keys the fleet's caches hold: KV tokens of all replicas × bytes per token /
    /// `chunk_size`.
    pub engine_index_capacity: u32,
    /// The served models' chat templates, compiled (`chat_template`: every model's; `models`:
    /// each model's own). A chat request whose model has one is keyed over the prompt that
    /// template renders; any other as `tools_position` says.
    pub templates: Templates,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: PolicyKind::CacheAware,
            header: "x-gateway-destination-endpoint".to_string(),
            chunk_size: 512,
            max_chunks: 256,
            group_bytes: 4096,
            cache_threshold: 0.3,
            balance_abs_threshold: 4,
            balance_rel_threshold: 1.5,
            prefill_bytes_per_ms: 40.0,
            session_header: "x-session-id".to_string(),
            admin_cluster: None,
            clusters: Vec::new(),
            engine_metrics_cluster: None,
            engine_metrics_path: "/metrics".to_string(),
            stats_interval_ms: 1000,
            endpoints: Vec::new(),
            max_body_bytes: 4 << 20,
            affinity_capacity: 16384,
            debug_header: false,
            fallback_endpoints: 1,
            unsafe_trap_path_for_tests: None,
            tools_position: ToolsAt::default(),
            eviction_grace_ms: 5000,
            index_cluster: None,
            index_path: "/v1/changes".to_string(),
            engine_index_capacity: 16384,
            templates: Templates::default(),
        }
    }
}

/// A configuration error, naming the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid kvroute config: field `{}`: {}",
            self.field, self.reason
        )
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl Config {
    /// How this config cuts a prompt into keys.
    pub fn shape(&self) -> Shape {
        Shape {
            chunk_size: self.chunk_size,
            max_chunks: self.max_chunks,
            group_bytes: self.group_bytes,
        }
    }

    /// Whether `cluster` is one kvroute polls (the admin, the indexer) rather than routes to.
    pub fn is_own_cluster(&self, cluster: &str) -> bool {
        [&self.admin_cluster, &self.index_cluster]
            .iter()
            .any(|own| own.as_deref() == Some(cluster))
    }

    /// Parses the plugin configuration. Empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("(configuration)", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(err("(configuration)", "must be a JSON object"));
        };
        Config::from_map(&map)
    }

    fn from_map(map: &Map<String, Value>) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        for (field, v) in map {
            let f = field.as_str();
            match f {
                "policy" => {
                    let name = string(f, v)?;
                    c.policy = name.parse().map_err(|_| {
                        let names = PolicyKind::VARIANTS.join(", ");
                        err(f, format!("unknown policy {name:?}; one of {names}"))
                    })?;
                }
                "header" => c.header = header_name(f, v)?,
                "session_header" => c.session_header = header_name(f, v)?,
                "chunk_size" => c.chunk_size = int(f, v, 16, 1 << 20)? as usize,
                "max_chunks" => c.max_chunks = int(f, v, 1, 4096)? as usize,
                "group_bytes" => c.group_bytes = int(f, v, 1, 1 << 20)? as usize,
                "cache_threshold" => c.cache_threshold = float(f, v, 0.0, 1.0)?,
                "balance_abs_threshold" => c.balance_abs_threshold = int(f, v, 0, 1 << 32)?,
                "balance_rel_threshold" => c.balance_rel_threshold = float(f, v, 1.0, 1e6)?,
                "prefill_bytes_per_ms" => c.prefill_bytes_per_ms = float(f, v, 0.001, 1e9)?,
                "admin_cluster" => c.admin_cluster = optional_name(f, v)?,
                "clusters" => c.clusters = names(f, v)?,
                "engine_metrics_cluster" => c.engine_metrics_cluster = optional_name(f, v)?,
                "engine_metrics_path" => c.engine_metrics_path = path(f, v)?,
                "stats_interval_ms" => c.stats_interval_ms = int(f, v, 50, 3_600_000)?,
                "endpoints" => c.endpoints = endpoints(f, v)?,
                "max_body_bytes" => c.max_body_bytes = int(f, v, 1, 64 << 20)? as usize,
                "affinity_capacity" => c.affinity_capacity = int(f, v, 1, 1 << 24)? as u32,
                "debug_header" => {
                    c.debug_header = v.as_bool().ok_or_else(|| err(f, "must be true or false"))?
                }
                "fallback_endpoints" => c.fallback_endpoints = int(f, v, 0, 8)? as usize,
                "eviction_grace_ms" => c.eviction_grace_ms = int(f, v, 0, 3_600_000)?,
                "index_cluster" => c.index_cluster = optional_name(f, v)?,
                "index_path" => c.index_path = path(f, v)?,
                "engine_index_capacity" => c.engine_index_capacity = int(f, v, 1, 1 << 24)? as u32,
                "unsafe_trap_path_for_tests" => c.unsafe_trap_path_for_tests = Some(path(f, v)?),
                "tools_position" => {
                    let name = string(f, v)?;
                    c.tools_position = name.parse().map_err(|_| {
                        let names = ToolsAt::VARIANTS.join(", ");
                        err(f, format!("unknown {name:?}; one of {names}"))
                    })?;
                }
                "chat_template" => c.templates.set_default(v).map_err(|e| err(f, e))?,
                "models" => c.templates.set_models(v).map_err(|e| err(f, e))?,
                _ => return Err(err(f, "unknown field")),
            }
        }
        if c.header == c.session_header {
            return Err(err("session_header", "must differ from `header`"));
        }
        Ok(c)
    }
}

fn string<'v>(field: &str, v: &'v Value) -> Result<&'v str, ConfigError> {
    v.as_str()
        .ok_or_else(|| err(field, format!("must be a string, got {v}")))
}

/// A URL path: starts with '/'.
fn path(field: &str, v: &Value) -> Result<String, ConfigError> {
    let path = string(field, v)?;
    if !path.starts_with('/') {
        return Err(err(field, format!("{path:?} must start with '/'")));
    }
    Ok(path.to_string())
}

/// A cluster name; empty means none.
fn optional_name(field: &str, v: &Value) -> Result<Option<String>, ConfigError> {
    let name = string(field, v)?;
    Ok((!name.is_empty()).then(|| name.to_string()))
}

fn int(field: &str, v: &Value, min: u64, max: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(err(
            field,
            format!("must be an integer from {min} to {max}, got {v}"),
        )),
    }
}

fn float(field: &str, v: &Value, min: f64, max: f64) -> Result<f64, ConfigError> {
    match v.as_f64() {
        Some(x) if (min..=max).contains(&x) => Ok(x),
        _ => Err(err(
            field,
            format!("must be a number from {min} to {max}, got {v}"),
        )),
    }
}

fn header_name(field: &str, v: &Value) -> Result<String, ConfigError> {
    let name = string(field, v)?;
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(err(
            field,
            format!("{name:?} is not a lowercase HTTP header name"),
        ));
    }
    Ok(name.to_string())
}

/// A list of non-empty cluster names.
fn names(field: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let list = v
        .as_array()
        .ok_or_else(|| err(field, "must be a list of cluster names"))?;
    list.iter()
        .map(|item| match optional_name(field, item)? {
            Some(name) => Ok(name),
            None => Err(err(field, "a cluster name is empty")),
        })
        .collect()
}

fn endpoints(field: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let list = v
        .as_array()
        .ok_or_else(|| err(field, "must be a list of \"ip:port\" strings"))?;
    list.iter()
        .map(|item| {
            let s = string(field, item)?;
            s.parse::<SocketAddr>()
                .map(|a| a.to_string())
                .map_err(|_| err(field, format!("{s:?} is not an ip:port address")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_test_trap_is_off_unless_configured_and_never_shipped() {
        assert_eq!(Config::default().unsafe_trap_path_for_tests, None);
        for shipped in [
            include_str!("../envoy/kvroute.yaml"),
            include_str!("../istio/body-routing/kvroute-ecds.yaml"),
            include_str!("../istio/header-routing/kvroute-wasmplugin.yaml"),
        ] {
            assert!(!shipped.contains("unsafe_trap"));
        }
        let c = Config::parse(br#"{"unsafe_trap_path_for_tests":"/trap"}"#).unwrap();
        assert_eq!(c.unsafe_trap_path_for_tests.as_deref(), Some("/trap"));
        assert!(Config::parse(br#"{"unsafe_trap_path_for_tests":"trap"}"#).is_err());
    }

    use super::*;

    #[test]
    fn empty_configuration_gives_the_documented_defaults() {
        let c = Config::parse(b"").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.policy, PolicyKind::CacheAware);
        assert_eq!(c.cache_threshold, 0.3);
        assert_eq!(c.balance_abs_threshold, 4);
        assert_eq!(c.group_bytes, 4096);
        assert_eq!(c.balance_rel_threshold, 1.5);
        assert_eq!(c.header, "x-gateway-destination-endpoint");
        assert_eq!(c.tools_position, ToolsAt::AfterSystem);
    }

    #[test]
    fn every_field_is_read() {
        let c = Config::parse(
            br#"{"policy":"session","header":"x-dest","chunk_size":64,"max_chunks":8,"group_bytes":100,
                "cache_threshold":0.5,"balance_abs_threshold":4,"balance_rel_threshold":2,
                "session_header":"x-user","admin_cluster":"admin","stats_interval_ms":200,
                "clusters":["pool","other"],
                "engine_metrics_cluster":"pool","engine_metrics_path":"/m",
                "endpoints":["127.0.0.1:8001"],"max_body_bytes":1000,"affinity_capacity":64,
                "debug_header":true,"fallback_endpoints":0,"tools_position":"before_last_user",
                "index_cluster":"indexer","index_path":"/changes","engine_index_capacity":99}"#,
        )
        .unwrap();
        assert_eq!(c.policy, PolicyKind::Session);
        assert_eq!(
            (c.chunk_size, c.max_chunks, c.affinity_capacity),
            (64, 8, 64)
        );
        assert_eq!(c.group_bytes, 100);
        assert_eq!(c.endpoints, vec!["127.0.0.1:8001"]);
        assert_eq!(c.admin_cluster.as_deref(), Some("admin"));
        assert_eq!(c.clusters, vec!["pool", "other"]);
        assert_eq!(c.engine_metrics_cluster.as_deref(), Some("pool"));
        assert_eq!(c.engine_metrics_path, "/m");
        assert!(c.debug_header);
        assert_eq!(c.tools_position, ToolsAt::BeforeLastUser);
        assert_eq!(c.index_cluster.as_deref(), Some("indexer"));
        assert_eq!(
            (c.index_path.as_str(), c.engine_index_capacity),
            ("/changes", 99)
        );
        let t = Config::parse(
            br#"{"chat_template":"{{ messages[0].content }}",
                "models":{"qwen":{"chat_template":"{{ bos_token }}","bos_token":"<s>","model_max_length":8}}}"#,
        )
        .unwrap();
        assert!(
            t.templates.for_model("qwen").is_some() && t.templates.for_model("other").is_some()
        );
        assert_ne!(t, Config::default());
    }

    #[test]
    fn errors_name_the_field() {
        for (json, field) in [
            (r#"{"chunk_size":0}"#, "chunk_size"),
            (r#"{"chunk_size":"big"}"#, "chunk_size"),
            (r#"{"group_bytes":0}"#, "group_bytes"),
            (r#"{"cache_threshold":1.5}"#, "cache_threshold"),
            (r#"{"balance_rel_threshold":0.5}"#, "balance_rel_threshold"),
            (r#"{"policy":"random"}"#, "policy"),
            (r#"{"endpoints":["nowhere"]}"#, "endpoints"),
            (r#"{"header":"X Bad"}"#, "header"),
            (r#"{"typo_field":1}"#, "typo_field"),
            (r#"{"clusters":"pool"}"#, "clusters"),
            (r#"{"clusters":[""]}"#, "clusters"),
            (r#"{"affinity_capacity":0}"#, "affinity_capacity"),
            (r#"{"tools_position":"first"}"#, "tools_position"),
            (r#"{"tools_position":1}"#, "tools_position"),
            (r#"{"index_path":"changes"}"#, "index_path"),
            (r#"{"engine_index_capacity":0}"#, "engine_index_capacity"),
            (r#"{"chat_template":"{% if %}"}"#, "chat_template"),
            (r#"{"chat_template":{"bos_token":"<s>"}}"#, "chat_template"),
            (r#"{"models":{"m":"{{ x"}}"#, "models"),
            (r#"{"models":["m"]}"#, "models"),
            (
                r#"{"engine_metrics_path":"metrics"}"#,
                "engine_metrics_path",
            ),
        ] {
            let e = Config::parse(json.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}");
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn policy_and_tools_position_names_stay_the_config_values_in_use() {
        let policies = [
            ("cache_aware", PolicyKind::CacheAware),
            ("round_robin", PolicyKind::RoundRobin),
            ("least_request", PolicyKind::LeastRequest),
            ("session", PolicyKind::Session),
            ("prefix_hash", PolicyKind::PrefixHash),
        ];
        assert_eq!(PolicyKind::VARIANTS, policies.map(|(n, _)| n));
        for (name, policy) in policies {
            let c = Config::parse(format!(r#"{{"policy":"{name}"}}"#).as_bytes()).unwrap();
            assert_eq!(c.policy, policy);
        }
        let positions = [
            ("after_system", ToolsAt::AfterSystem),
            ("before_system", ToolsAt::BeforeSystem),
            ("before_last_user", ToolsAt::BeforeLastUser),
        ];
        assert_eq!(ToolsAt::VARIANTS, positions.map(|(n, _)| n));
        for (name, at) in positions {
            let json = format!(r#"{{"tools_position":"{name}"}}"#);
            assert_eq!(Config::parse(json.as_bytes()).unwrap().tools_position, at);
        }
        let e = Config::parse(br#"{"policy":"Session"}"#).unwrap_err();
        assert!(
            e.to_string().contains("one of cache_aware, round_robin,"),
            "{e}"
        );
    }

    #[test]
    fn non_object_configuration_is_refused() {
        assert!(Config::parse(b"[1]").is_err());
        assert!(Config::parse(b"{").is_err());
    }
}
