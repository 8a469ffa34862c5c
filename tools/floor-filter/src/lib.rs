//! The floor: a proxy-wasm HTTP filter that pauses every request with a body until the body is
//! complete, reads it into the VM, and lets it go unchanged. Any body-routing filter pays at least
//! this; `kvroute-bench overhead` measures kvroute against it (config `floor`).

#[cfg(target_arch = "wasm32")]
mod filter {
    use proxy_wasm::traits::{Context, HttpContext};
    use proxy_wasm::types::Action;

    struct Floor;

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
            Action::Continue
        }
    }

    proxy_wasm::main! {{
        proxy_wasm::set_http_context(|_, _| -> Box<dyn HttpContext> { Box::new(Floor) });
    }}
}
