//! Finding the engines from Envoy's admin: the hosts of one cluster, polled, each host's
//! KV-event socket on a fixed port.

use crate::config::{Discovery, EngineSpec, Events};
use crate::state::Shared;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// How often the cluster is read.
const POLL: Duration = Duration::from_secs(5);

/// Subscribes to every host `cluster` gains, for as long as the process runs.
pub async fn run(shared: Arc<Shared>, events: Events, discovery: Discovery, admin: String) {
    let (Some(cluster), Some(port)) = (discovery.cluster.clone(), discovery.kv_events_port) else {
        return;
    };
    let mut known: HashSet<String> = events.engines.iter().map(|e| e.endpoint.clone()).collect();
    loop {
        match get(&format!(
            "{}/clusters?format=json",
            admin.trim_end_matches('/')
        ))
        .await
        {
            Ok(body) => {
                for (host, endpoint) in hosts(&body, &cluster) {
                    if known.insert(endpoint.clone()) {
                        subscribe(
                            &shared, &events, &discovery, &cluster, &host, &endpoint, port,
                        );
                    }
                }
            }
            Err(e) => log::warn!("{admin}: {e}"),
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Subscribes to every data-parallel rank of a new engine at `host`.
fn subscribe(
    shared: &Arc<Shared>,
    events: &Events,
    discovery: &Discovery,
    cluster: &str,
    host: &str,
    endpoint: &str,
    port: u16,
) {
    let spec = EngineSpec {
        endpoint: endpoint.to_owned(),
        events: format!("tcp://{host}:{port}"),
        replay: discovery.replay_port.map(|p| format!("tcp://{host}:{p}")),
        kind: Some(events.engine_kind),
        dp_size: discovery.dp_size,
        ..EngineSpec::default()
    };
    log::info!("{cluster}: new endpoint {endpoint}");
    if let Err(e) = crate::subscribe_engine(shared, events, &spec) {
        log::warn!("{cluster}: {endpoint}: {e}");
    }
}

/// `(host, "host:port")` of every host of `cluster` in Envoy's `/clusters?format=json`.
pub fn hosts(body: &[u8], cluster: &str) -> Vec<(String, String)> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let statuses = v["cluster_statuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    statuses
        .iter()
        .filter(|c| c["name"].as_str() == Some(cluster))
        .flat_map(|c| c["host_statuses"].as_array().cloned().unwrap_or_default())
        .filter_map(|h| {
            let a = &h["address"]["socket_address"];
            let host = a["address"].as_str()?.to_owned();
            let port = a["port_value"].as_u64()?;
            // An IPv6 address is bracketed, in the endpoint and in the ZeroMQ address alike.
            let host = if host.contains(':') {
                format!("[{host}]")
            } else {
                host
            };
            let endpoint = format!("{host}:{port}");
            Some((host, endpoint))
        })
        .collect()
}

/// A plain HTTP/1.1 GET of `url` (`http://host:port/path`).
async fn get(url: &str) -> Result<Vec<u8>, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let authority = uri
        .authority()
        .ok_or("no host in the admin address")?
        .to_string();
    let stream = tokio::net::TcpStream::connect(&authority)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", authority)
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(body.to_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_the_named_cluster_only() {
        let body = br#"{"cluster_statuses":[
            {"name":"other","host_statuses":[{"address":{"socket_address":{"address":"127.0.0.9","port_value":1}}}]},
            {"name":"vllm","host_statuses":[
                {"address":{"socket_address":{"address":"127.0.0.1","port_value":8000}}},
                {"address":{"socket_address":{"address":"127.0.0.2","port_value":8001}}}]}]}"#;
        assert_eq!(
            hosts(body, "vllm"),
            vec![
                ("127.0.0.1".into(), "127.0.0.1:8000".into()),
                ("127.0.0.2".into(), "127.0.0.2:8001".into())
            ]
        );
        assert!(hosts(b"not json", "vllm").is_empty());
        let v6 = br#"{"cluster_statuses":[{"name":"vllm","host_statuses":[
            {"address":{"socket_address":{"address":"::1","port_value":8000}}}]}]}"#;
        assert_eq!(
            hosts(v6, "vllm"),
            vec![("[::1]".into(), "[::1]:8000".into())]
        );
    }
}
