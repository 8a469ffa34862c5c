//! The floor: a proxy-wasm HTTP filter that pauses every request with a body until the body is
//! complete, reads it into the VM, and lets it go unchanged. Any body-routing filter pays at least
//! this; `kvroute-bench overhead` measures kvroute against it (config `floor`).
//!
//! Opt-in, for the `floor+header` config: with a plugin configuration `{"header_values": [..]}`
//! it also writes `x-gateway-destination-endpoint`, taking the listed values in turn, so a run can
//! show what Envoy itself spends honouring that header (override_host) apart from what kvroute
//! spends deciding it. Without a configuration it writes nothing.

#[cfg(target_arch = "wasm32")]
mod filter {
    use std::cell::Cell;
    use std::rc::Rc;

    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType};

    /// The header Envoy's override_host policy reads (the one kvroute writes).
    const HEADER: &str = "x-gateway-destination-endpoint";

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
    }

    #[derive(Default)]
    struct Root {
        values: Rc<Values>,
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
                    true
                }
                Err(_) => bytes.iter().all(u8::is_ascii_whitespace),
            }
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Floor {
                values: self.values.clone(),
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Floor {
        values: Rc<Values>,
    }

    impl Context for Floor {}

    impl HttpContext for Floor {
        fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
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
            if let Some(value) = self.values.take() {
                self.set_http_request_header(HEADER, Some(value));
            }
            Action::Continue
        }
    }

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::<Root>::default() });
    }}
}
