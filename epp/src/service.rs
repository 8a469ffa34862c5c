//! The gRPC services: Envoy's ext_proc, each stream handed to a worker for its whole life, and
//! gRPC health (liveness, readiness and the ext_proc service, as the endpoint picker protocol
//! names them).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::extproc::{Options, Stream};
use crate::worker::Workers;

/// The health service names the protocol defines beside the ext_proc service's own.
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";

/// The ext_proc service.
pub struct Picker {
    workers: Arc<Workers>,
    options: Arc<Options>,
    next_stream: AtomicU64,
}

impl Picker {
    pub fn new(workers: Arc<Workers>, options: Options) -> Picker {
        Picker {
            workers,
            options: Arc::new(options),
            next_stream: AtomicU64::new(0),
        }
    }
}

type Answers = Pin<Box<dyn tokio_stream::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let mut stream = Stream::new(id, self.workers.next(), self.options.clone());
        // Envoy sends one message and waits for its answers before the next, so a few suffice.
        let (answers, out) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                let Ok(responses) = stream.step(message).await else {
                    let _ = answers
                        .send(Err(Status::unavailable("kvroute-epp is stopping")))
                        .await;
                    break;
                };
                for response in responses {
                    if answers.send(Ok(response)).await.is_err() {
                        break;
                    }
                }
            }
            stream.end();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}
