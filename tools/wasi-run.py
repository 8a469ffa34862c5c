#!/usr/bin/env python3
"""Runs a WASI (wasm32-wasip1) command module, such as a `cargo test` binary, under wasmtime."""
import sys

import wasmtime


def main() -> int:
    path, args = sys.argv[1], sys.argv[1:]
    engine = wasmtime.Engine()
    module = wasmtime.Module.from_file(engine, path)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    wasi = wasmtime.WasiConfig()
    wasi.argv = args
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    wasi.inherit_env()
    store = wasmtime.Store(engine)
    store.set_wasi(wasi)
    instance = linker.instantiate(store, module)
    try:
        instance.exports(store)["_start"](store)
    except wasmtime.ExitTrap as exit_:
        return exit_.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
