//! The floor: a proxy-wasm HTTP filter that pauses every request with a body until the body is
//! complete, reads it into the VM, and lets it go unchanged. Any body-routing filter pays at least
//! this; `kvroute-overhead cpu` measures kvroute against it (config `floor`).
//!
//! Opt-in, for the `floor+header` config: with a plugin configuration `{"header_values": [..]}`
//! it also writes `x-gateway-destination-endpoint`, taking the listed values in turn, so a run can
//! show what Envoy itself spends honouring that header (override_host) apart from what kvroute
//! spends deciding it. Without a configuration it writes nothing.
//!
//! Opt-in too, for the `floor+reads` config: with `"reads": true` it also makes the host calls
//! kvroute makes on its common path, and nothing with their answers: the request's header map,
//! the route's cluster, the time, one shared-data read, the serving host at the response headers
//! and the end of each response body chunk. A run then splits kvroute's cost into what any filter
//! asking Envoy those things pays (the proxy-wasm boundary, Envoy's side of each call) and what
//! kvroute's own code spends.

#[cfg(target_arch = "wasm32")]
mod filter {
    use std::cell::Cell;
    use std::rc::Rc;

    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, BufferType, ContextType, MapType};

    /// The header Envoy's override_host policy reads (the one kvroute writes).
    const HEADER: &str = "x-gateway-destination-endpoint";
    /// How much of each response body chunk `reads` takes: what kvroute keeps to find `usage`.
    const TAIL_BYTES: usize = 4096;
    /// The shared-data key `reads` reads.
    const SHARED_KEY: &str = "floor.reads";

    /// What to write: the values in turn, one per request (none: write nothing).
    #[derive(Default)]
    struct Values {
        list: Vec<String>,
        next: Cell<usize>,
    }

    impl Values {
        fn take(&self) -> Option<&str> {
            let n = self.next.get();
            self.next.set(n.wrapping_add(1));
            self.list
                .get(n % self.list.len().max(1))
                .map(String::as_str)
        }
    }

    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        header_values: Vec<String>,
        #[serde(default)]
        reads: bool,
    }

    #[derive(Default)]
    struct Root {
        values: Rc<Values>,
        reads: bool,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let Some(bytes) = self.get_plugin_configuration() else {
                return true;
            };
            // An empty or `{}` configuration is the plain floor.
            match serde_json::from_slice::<Config>(&bytes) {
                Ok(config) => {
                    self.values = Rc::new(Values {
                        list: config.header_values,
                        next: Cell::new(0),
                    });
                    self.reads = config.reads;
                    if self.reads {
                        // What the read finds: about one affinity slot of kvroute's (4 records).
                        let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&[0; 150]), None);
                    }
                    true
                }
                Err(_) => bytes.iter().all(u8::is_ascii_whitespace),
            }
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Floor {
                values: self.values.clone(),
                reads: self.reads,
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Floor {
        values: Rc<Values>,
        reads: bool,
    }

    impl Context for Floor {}

    impl HttpContext for Floor {
        fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
            if self.reads {
                std::hint::black_box(hostcalls::get_map_bytes(MapType::HttpRequestHeaders).ok());
            }
            if end_of_stream {
                Action::Continue
            } else {
                Action::Pause
            }
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                return Action::Pause;
            }
            // Copy the whole body into the VM, as a filter that looks at it must.
            let body = self.get_http_request_body(0, body_size).unwrap_or_default();
            std::hint::black_box(body);
            if self.reads {
                std::hint::black_box(hostcalls::get_property(vec!["xds", "cluster_name"]).ok());
                std::hint::black_box(hostcalls::get_current_time().ok());
                std::hint::black_box(hostcalls::get_shared_data(SHARED_KEY).ok());
            }
            if let Some(value) = self.values.take() {
                self.set_http_request_header(HEADER, Some(value));
            }
            Action::Continue
        }

        fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
            if self.reads {
                std::hint::black_box(hostcalls::get_property(vec!["upstream", "address"]).ok());
            }
            Action::Continue
        }

        fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
            if self.reads && body_size > 0 {
                let want = body_size.min(TAIL_BYTES);
                let end =
                    hostcalls::get_buffer(BufferType::HttpResponseBody, body_size - want, want);
                std::hint::black_box(end.ok());
            }
            Action::Continue
        }
    }

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::<Root>::default() });
    }}
}
