//! A Kubernetes API server on 127.0.0.1 for the picker's InferencePool watch, answering as the
//! real one does: a list (`kind: PodList`, its `resourceVersion`) with the label or field
//! selector applied, and a watch from a `resourceVersion`, a chunked stream of
//! `{"type": ..., "object": ...}` lines (the changes since, then each change the test makes).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

pub const NAMESPACE: &str = "inference";
pub const PODS: &str = "/api/v1/namespaces/inference/pods";
pub const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools";

/// The two collections it serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Pods,
    Pools,
}

impl Kind {
    fn of(path: &str) -> Option<Kind> {
        match path {
            PODS => Some(Kind::Pods),
            POOLS => Some(Kind::Pools),
            _ => None,
        }
    }

    fn list(self) -> (&'static str, &'static str) {
        match self {
            Kind::Pods => ("PodList", "v1"),
            Kind::Pools => ("InferencePoolList", "inference.networking.k8s.io/v1"),
        }
    }
}

/// What a request selects: a label selector's `key=value`s, or a field selector's name.
enum Selector {
    Labels(BTreeMap<String, String>),
    Name(String),
}

impl Selector {
    fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        match self {
            Selector::Labels(labels) => labels
                .iter()
                .all(|(k, v)| meta["labels"][k].as_str() == Some(v)),
            Selector::Name(name) => meta["name"].as_str() == Some(name),
        }
    }
}

/// A change to one object: its state before and after (`None`: absent).
struct Change {
    version: u64,
    kind: Kind,
    old: Option<Value>,
    new: Option<Value>,
}

impl Change {
    /// The watch event a watcher with `selector` sees of it, as the API server sends it (an
    /// object that starts or stops matching is `ADDED` or `DELETED`).
    fn line(&self, selector: &Option<Selector>) -> Option<Bytes> {
        let matches = |o: &&Value| selector.as_ref().is_none_or(|s| s.matches(o));
        let (old, new) = (self.old.as_ref(), self.new.as_ref());
        let seen = (old.filter(matches), new.filter(matches));
        let (kind, object) = match seen {
            (None, Some(new)) => ("ADDED", new),
            (Some(_), Some(new)) => ("MODIFIED", new),
            (Some(old), None) => ("DELETED", new.unwrap_or(old)),
            (None, None) => return None,
        };
        let mut object = object.clone();
        object["metadata"]["resourceVersion"] = self.version.to_string().into();
        Some(event_line(kind, object))
    }
}

fn event_line(kind: &str, object: Value) -> Bytes {
    let mut line = json!({ "type": kind, "object": object }).to_string();
    line.push('\n');
    Bytes::from(line)
}

struct Watcher {
    kind: Kind,
    selector: Option<Selector>,
    lines: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct State {
    version: u64,
    objects: BTreeMap<(String, String), Value>,
    changes: Vec<Change>,
    watchers: Vec<Watcher>,
    /// Each request's path and query, in order.
    requests: Vec<String>,
}

/// The server; stops when dropped.
pub struct KubeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Whether pod lists are answered (held until the test opens them).
    pod_lists: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubeApi {
    /// Serves `objects` (pods and InferencePools); pod lists wait for [`KubeApi::open_pod_lists`]
    /// unless `pod_lists_open`.
    pub async fn start(objects: Vec<Value>, pod_lists_open: bool) -> KubeApi {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let (pod_lists, _) = watch::channel(pod_lists_open);
        let served = (state.clone(), pod_lists.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let (state, pod_lists) = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        answer(req, state.clone(), pod_lists.subscribe())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(conn), service)
                        .await;
                });
            }
        });
        let api = KubeApi {
            addr,
            state,
            pod_lists,
            task,
        };
        for object in objects {
            api.put(object);
        }
        api
    }

    /// The client configuration that reaches it.
    pub fn config(&self) -> kube::Config {
        kube::Config::new(format!("http://{}", self.addr).parse().unwrap())
    }

    pub fn open_pod_lists(&self) {
        self.pod_lists.send_replace(true);
    }

    /// Each request's path and query so far.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// Creates or replaces an object (`ADDED` or `MODIFIED` to its watchers).
    pub fn put(&self, object: Value) {
        self.change(key(&object), Some(object));
    }

    /// Deletes the object `kind` (`"Pod"`, `"InferencePool"`) `name`.
    pub fn delete(&self, kind: &str, name: &str) {
        self.change((kind.to_string(), name.to_string()), None);
    }

    /// A `BOOKMARK` to every pod watcher: the version they have seen up to.
    pub fn bookmark(&self) {
        let state = self.lock();
        let object = json!({ "kind": "Pod", "apiVersion": "v1",
            "metadata": { "resourceVersion": state.version.to_string() } });
        for w in state.watchers.iter().filter(|w| w.kind == Kind::Pods) {
            let _ = w.lines.send(event_line("BOOKMARK", object.clone()));
        }
    }

    fn change(&self, key: (String, String), new: Option<Value>) {
        let mut state = self.lock();
        state.version += 1;
        let version = state.version;
        let kind = if key.0 == "Pod" {
            Kind::Pods
        } else {
            Kind::Pools
        };
        let new = new.map(|mut o| {
            o["metadata"]["resourceVersion"] = version.to_string().into();
            o
        });
        let old = match &new {
            Some(o) => state.objects.insert(key, o.clone()),
            None => state.objects.remove(&key),
        };
        let change = Change {
            version,
            kind,
            old,
            new,
        };
        state.watchers.retain(|w| {
            let line = (w.kind == kind).then(|| change.line(&w.selector)).flatten();
            line.is_none_or(|l| w.lines.send(l).is_ok())
        });
        state.changes.push(change);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn key(object: &Value) -> (String, String) {
    let kind = object["kind"].as_str().expect("an object has a kind");
    let name = object["metadata"]["name"].as_str().expect("and a name");
    (kind.to_string(), name.to_string())
}

type Body = BoxBody<Bytes, Infallible>;

async fn answer(
    req: Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
    mut pod_lists: watch::Receiver<bool>,
) -> Result<Response<Body>, Infallible> {
    let uri = req.uri().clone();
    let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
    lock().requests.push(uri.to_string());
    let query: BTreeMap<String, String> =
        url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let Some(kind) = Kind::of(uri.path()) else {
        return Ok(status(StatusCode::NOT_FOUND, "NotFound"));
    };
    let selector = if let Some(labels) = query.get("labelSelector") {
        let pairs = labels.split(',').map(|e| {
            let (k, v) = e.split_once('=').expect("only key=value selectors");
            (k.to_string(), v.to_string())
        });
        Some(Selector::Labels(pairs.collect()))
    } else {
        query.get("fieldSelector").map(|f| {
            let name = f
                .strip_prefix("metadata.name=")
                .expect("only a name selector");
            Selector::Name(name.to_string())
        })
    };
    if query.get("watch").map(String::as_str) == Some("true") {
        let since: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (lines, out) = mpsc::unbounded_channel();
        let mut state = lock();
        for change in state
            .changes
            .iter()
            .filter(|c| c.kind == kind && c.version > since)
        {
            if let Some(line) = change.line(&selector) {
                let _ = lines.send(line);
            }
        }
        state.watchers.push(Watcher {
            kind,
            selector,
            lines,
        });
        let frames = UnboundedReceiverStream::new(out).map(|l| Ok(Frame::data(l)));
        let body = StreamBody::new(frames).boxed();
        let response = Response::builder()
            .header("content-type", "application/json")
            .body(body);
        return Ok(response.unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR, "")));
    }
    if kind == Kind::Pods {
        let _ = pod_lists.wait_for(|open| *open).await;
    }
    let state = lock();
    let (list_kind, api_version) = kind.list();
    let items: Vec<Value> = state
        .objects
        .iter()
        .filter(|((k, _), _)| (*k == "Pod") == (kind == Kind::Pods))
        .map(|(_, o)| o)
        .filter(|o| selector.as_ref().is_none_or(|s| s.matches(o)))
        .map(|o| {
            let mut item = o.clone();
            if kind == Kind::Pods {
                // A core list's items carry no kind of their own.
                let fields = item.as_object_mut().expect("an object");
                fields.remove("kind");
                fields.remove("apiVersion");
            }
            item
        })
        .collect();
    let list = json!({
        "kind": list_kind,
        "apiVersion": api_version,
        "metadata": { "resourceVersion": state.version.to_string() },
        "items": items
    });
    Ok(json_response(StatusCode::OK, &list))
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    let body = Full::new(Bytes::from(value.to_string())).boxed();
    let response = Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(body);
    response.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

/// An error as the API server answers it: a `Status` object.
fn status(code: StatusCode, reason: &str) -> Response<Body> {
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "the server could not find the requested resource",
        "reason": reason, "code": code.as_u16()
    });
    json_response(code, &status)
}

/// An InferencePool selecting `labels`, served at `ports`.
pub fn inference_pool(name: &str, labels: &[(&str, &str)], ports: &[u16]) -> Value {
    let labels: BTreeMap<_, _> = labels.iter().copied().collect();
    let ports: Vec<Value> = ports.iter().map(|p| json!({ "number": p })).collect();
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": name, "namespace": NAMESPACE, "generation": 1,
            "uid": format!("uid-pool-{name}") },
        "spec": {
            "selector": { "matchLabels": labels },
            "targetPorts": ports,
            "endpointPickerRef": { "name": "kvroute-epp", "port": { "number": 9002 } }
        }
    })
}

/// A pod as the kubelet reports it: `Running` and `Ready` or not, with `ip` once it has one.
pub fn pod(name: &str, labels: &[(&str, &str)], ip: Option<&str>, ready: bool) -> Value {
    let labels: BTreeMap<_, _> = labels.iter().copied().collect();
    let ready = if ready { "True" } else { "False" };
    let mut status = json!({
        "phase": "Running",
        "conditions": [
            { "type": "Initialized", "status": "True" },
            { "type": "ContainersReady", "status": ready },
            { "type": "Ready", "status": ready }
        ]
    });
    if let Some(ip) = ip {
        status["podIP"] = ip.into();
        status["podIPs"] = json!([{ "ip": ip }]);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": NAMESPACE, "labels": labels,
            "uid": format!("uid-pod-{name}") },
        "spec": { "containers": [{ "name": "vllm", "image": "vllm/vllm-openai" }] },
        "status": status
    })
}
