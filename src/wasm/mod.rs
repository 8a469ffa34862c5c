//! The proxy-wasm adapter: registers kvroute's root context with Envoy. Kept thin on purpose: the
//! contexts move bytes between Envoy and the host-agnostic core, nothing else.

mod host;
mod http;
mod poll;
mod response;
mod root;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
