//! The proxy-wasm adapter: registers kvroute's root context with Envoy. Kept thin on purpose: the
//! contexts turn Envoy's callbacks into calls of the host-agnostic [`Gateway`](crate::gateway),
//! and carry out what it answers.

mod host;
mod http;
mod root;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
