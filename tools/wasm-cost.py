#!/usr/bin/env python3
"""The filter's own cost per request and per idle tick, without Envoy: runs kvroute.wasm under
wasmtime with a stand-in proxy-wasm host, and prints the wasm instructions each callback executes
(wasmtime's fuel, deterministic) and the host calls a request makes; then the same for idle ticks
every 100 ms, with the poll round (the admin `/clusters` and each engine's `/metrics`) every
500 ms that this VM, holding the poll lease, makes for a pool of `--hosts` endpoints.

The stand-in host answers the calls the filter makes the way Envoy does for the shipped config
(the admin `/clusters` and engine `/metrics` polls, shared data, headers, bodies, properties)
and drives each request through its callbacks: a chat request to one of 16 groups (128 distinct
bodies, as `kvroute-overhead cpu` sends), then a JSON response with `usage`. What Envoy itself
spends (its side of each host call, the wasm boundary) is not here: `kvroute-overhead instructions`
counts that. With `--perf`, no fuel is counted and wasmtime writes /tmp/perf-<pid>.map, so
`perf record -g` over this script names the filter's functions.

    wasm-cost.py target/wasm32-wasip1/release/kvroute.wasm [--requests N] [--bytes 1024,24576]
        [--hosts 4] [--ticks 50] [--chat-template FILE [--precise]] [--conversation]

`--chat-template FILE` (a raw Jinja template or a tokenizer_config.json) configures it as the
template of every model, so the requests are keyed over the prompt it renders; `--conversation`
sends each size as a conversation (a system prompt of a quarter of it, then turns of about 1 KB,
an assistant turn with its reasoning among them) instead of a system prompt and one question.
`--precise` (with `--chat-template`) runs precise mode: the filter also polls an indexer's change
feed, whose first answer says one endpoint's engine holds each group's shared prefix (its keys
computed by `kvroute-bench keys` over the template's rendering) and later ones change nothing, so
the engine index decides the requests; the engine decisions are printed with the counts.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import wasmtime

CONFIG = json.dumps({
    "policy": "cache_aware",
    "admin_cluster": "kvroute_admin",
    "engine_metrics_cluster": "inference_pool",
    "stats_interval_ms": 500,
}).encode()
# The stats Envoy's admin `/clusters?format=json` lists for each host.
HOST_STATS = [("cx_connect_fail", "COUNTER"), ("cx_total", "COUNTER"), ("rq_error", "COUNTER"),
              ("rq_success", "COUNTER"), ("rq_timeout", "COUNTER"), ("rq_total", "COUNTER"),
              ("cx_active", "GAUGE"), ("rq_active", "GAUGE")]


def clusters(hosts):
    """The admin `/clusters` document for a pool of `hosts` endpoints, as Envoy writes it."""
    return json.dumps({"cluster_statuses": [{
        "name": "inference_pool",
        "host_statuses": [{
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8001 + i}},
            "stats": [{"name": name, "type": kind, "value": "0"} for name, kind in HOST_STATS],
            "health_status": {"eds_health_status": "HEALTHY"},
            "weight": 1,
            "locality": {},
        } for i in range(hosts)],
    }]}).encode()


ENGINE_METRICS = b"""vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:request_success_total{model_name="m",finished_reason="stop"} 100.0
"""
RESPONSE = json.dumps({
    "id": "c", "object": "chat.completion", "model": "test",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 300, "completion_tokens": 16, "total_tokens": 316,
              "prompt_tokens_details": {"cached_tokens": 280}},
}).encode()
CALLBACKS = ["proxy_on_context_create", "proxy_on_request_headers", "proxy_on_request_body",
             "proxy_on_response_headers", "proxy_on_response_body", "proxy_on_log",
             "proxy_on_done", "proxy_on_delete"]
# proxy-wasm ABI 0.2.1 constants.
OK, NOT_FOUND, CAS_MISMATCH = 0, 1, 8
REQUEST_BODY, RESPONSE_BODY, CALL_RESPONSE_BODY, PLUGIN_CONFIGURATION = 0, 1, 4, 7
REQUEST_HEADERS, RESPONSE_HEADERS, CALL_RESPONSE_HEADERS = 0, 2, 6
ROOT = 1


SHAPE = {"conversation": False}
# The stand-in indexer's answers, by kind (`--precise`): see `precise_feed`.
FEED = {}


def body(i, size):
    """The overhead bench's bodies: 16 groups' system prompts, 128 questions."""
    if SHAPE["conversation"]:
        return conversation(i, size)
    system = ("Group %d system prompt. " % (i % 16)) * (size // 24)
    return json.dumps({"model": "test", "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Question %d: what is in the context?" % (i % 128)}]}).encode()


def conversation(i, size):
    """A conversation of about `size` bytes: 16 groups' system prompts of a quarter of it, then
    turns of about 1 KB, the 128 conversations told apart by their first question."""
    system = ("Group %d system prompt. " % (i % 16)) * (size // 4 // 24)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Question %d: what is in the context? " % (i % 128)}]
    turn = 0
    while len(json.dumps(messages)) < size:
        if turn % 2 == 0:
            messages.append({"role": "assistant", "content": "An answer in detail. " * 48,
                             "reasoning": "Some thought about it. " * 8})
        else:
            messages.append({"role": "user", "content": "A follow-up question, longer. " * 34})
        turn += 1
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "And then?"})
    return json.dumps({"model": "test", "max_tokens": 16, "messages": messages}).encode()


class Host:
    """Envoy's side of the ABI, for one VM."""

    def __init__(self, path, fuel, hosts):
        self.clusters = clusters(hosts)
        config = wasmtime.Config()
        config.consume_fuel = fuel
        if not fuel:
            config.profiler = "perfmap"
        engine = wasmtime.Engine(config)
        module = wasmtime.Module.from_file(engine, path)
        self.store = wasmtime.Store(engine)
        if fuel:
            self.store.set_fuel(2**62)
        self.fuel = fuel
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        wasi = wasmtime.WasiConfig()
        wasi.inherit_stderr()
        self.store.set_wasi(wasi)
        self.calls = {}
        self.shared = {}
        self.metric_names = []
        self.metrics = {}
        self.maps = {REQUEST_HEADERS: [], RESPONSE_HEADERS: [], CALL_RESPONSE_HEADERS: []}
        self.buffers = {PLUGIN_CONFIGURATION: CONFIG}
        self.properties = {}
        self.pending_calls = []
        self.now_ns = 1_700_000_000_000_000_000
        for imp in module.imports:
            if imp.module == "env":
                fn = getattr(self, imp.name[len("proxy_"):], None) or self.unhandled(imp.name)
                linker.define_func("env", imp.name, imp.type, self.counted(imp.name, fn))
        self.instance = linker.instantiate(self.store, module)
        self.exports = self.instance.exports(self.store)
        self.memory = self.exports["memory"]
        self.exports["_initialize"](self.store)

    def counted(self, name, fn):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)
        return call

    def unhandled(self, name):
        def call(*_args):
            return OK
        return call

    def read(self, ptr, size):
        return bytes(self.memory.read(self.store, ptr, ptr + size))

    def write(self, ptr, data):
        self.memory.write(self.store, data, ptr)

    def give(self, data, ptr_ptr, size_ptr):
        """Returns `data` the ABI's way: in memory the VM allocates (one more call into it)."""
        ptr = self.exports["proxy_on_memory_allocate"](self.store, len(data)) if data else 0
        if data:
            self.write(ptr, data)
        self.write(ptr_ptr, struct.pack("<I", ptr))
        self.write(size_ptr, struct.pack("<I", len(data)))
        return OK

    def run(self, export, *args):
        before = self.store.get_fuel() if self.fuel else 0
        result = self.exports[export](self.store, *args)
        spent = before - self.store.get_fuel() if self.fuel else 0
        return result, spent

    # The host calls kvroute makes.
    def log(self, level, ptr, size):
        if level >= 3:
            print("filter log:", self.read(ptr, size).decode(errors="replace"), file=sys.stderr)
        return OK

    def get_current_time_nanoseconds(self, ret):
        self.write(ret, struct.pack("<Q", self.now_ns))
        return OK

    def get_buffer_bytes(self, kind, start, max_size, ptr_ptr, size_ptr):
        start, max_size = start & 0xFFFFFFFF, max_size & 0xFFFFFFFF
        data = self.buffers.get(kind, b"")
        return self.give(data[start:start + max_size], ptr_ptr, size_ptr)

    def get_header_map_pairs(self, kind, ptr_ptr, size_ptr):
        pairs = self.maps.get(kind, [])
        out = struct.pack("<I", len(pairs))
        out += b"".join(struct.pack("<II", len(k), len(v)) for k, v in pairs)
        out += b"".join(k + b"\0" + v + b"\0" for k, v in pairs)
        return self.give(out, ptr_ptr, size_ptr)

    def get_header_map_value(self, kind, key_ptr, key_size, ptr_ptr, size_ptr):
        key = self.read(key_ptr, key_size)
        for k, v in self.maps.get(kind, []):
            if k == key:
                return self.give(v, ptr_ptr, size_ptr)
        return NOT_FOUND

    def replace_header_map_value(self, kind, key_ptr, key_size, value_ptr, value_size):
        key, value = self.read(key_ptr, key_size), self.read(value_ptr, value_size)
        pairs = self.maps.setdefault(kind, [])
        pairs[:] = [(k, v) for k, v in pairs if k != key] + [(key, value)]
        return OK

    def remove_header_map_value(self, kind, key_ptr, key_size):
        key = self.read(key_ptr, key_size)
        pairs = self.maps.setdefault(kind, [])
        pairs[:] = [(k, v) for k, v in pairs if k != key]
        return OK

    def get_property(self, path_ptr, path_size, ptr_ptr, size_ptr):
        path = self.read(path_ptr, path_size).rstrip(b"\0").replace(b"\0", b".").decode()
        if path not in self.properties:
            return NOT_FOUND
        return self.give(self.properties[path], ptr_ptr, size_ptr)

    def get_shared_data(self, key_ptr, key_size, ptr_ptr, size_ptr, cas_ptr):
        key = self.read(key_ptr, key_size)
        if key not in self.shared:
            return NOT_FOUND
        value, cas = self.shared[key]
        self.write(cas_ptr, struct.pack("<I", cas))
        return self.give(value, ptr_ptr, size_ptr)

    def set_shared_data(self, key_ptr, key_size, value_ptr, value_size, cas):
        key = self.read(key_ptr, key_size)
        current = self.shared.get(key)
        if cas and current and current[1] != cas:
            return CAS_MISMATCH
        self.shared[key] = (self.read(value_ptr, value_size), current[1] + 1 if current else 1)
        return OK

    def define_metric(self, _kind, name_ptr, name_size, id_ptr):
        self.metric_names.append(self.read(name_ptr, name_size).decode(errors="replace"))
        self.write(id_ptr, struct.pack("<I", len(self.metric_names) - 1))
        return OK

    def increment_metric(self, metric_id, offset):
        name = self.metric_names[metric_id]
        self.metrics[name] = self.metrics.get(name, 0) + offset
        return OK

    def record_metric(self, metric_id, value):
        self.metrics[self.metric_names[metric_id]] = value
        return OK

    def http_call(self, _up_ptr, _up_size, headers_ptr, headers_size, *rest):
        token_ptr = rest[-1]
        token = len(self.pending_calls) + 1
        raw = self.read(headers_ptr, headers_size)
        kind = "admin" if b"/clusters" in raw else "engine"
        if b"/v1/changes" in raw:
            # As an indexer answers: the whole index unless the filter is at its version.
            kind = "no change" if b"epoch=1&since=1\0" in raw else "whole index"
        self.pending_calls.append((token, kind))
        self.write(token_ptr, struct.pack("<I", token))
        return OK

    def tick(self, ms=500):
        """The root's tick `ms` after the last, then an answer to each call it made (a poll).
        Returns the wasm instructions of the tick and of the answers."""
        self.now_ns += ms * 1_000_000
        spent = self.run("proxy_on_tick", ROOT)[1]
        answers = 0
        calls, self.pending_calls = self.pending_calls, []
        for token, kind in calls:
            answer = {"admin": self.clusters, "engine": ENGINE_METRICS}.get(kind) or FEED[kind]
            self.maps[CALL_RESPONSE_HEADERS] = [(b":status", b"200")]
            self.buffers[CALL_RESPONSE_BODY] = answer
            answers += self.run("proxy_on_http_call_response", ROOT, token, 1, len(answer), 0)[1]
        return spent, answers

    def request(self, ctx, payload):
        """One request and its response through the filter: wasm instructions per callback."""
        self.now_ns += 1_000_000
        self.maps[REQUEST_HEADERS] = [
            (b":authority", b"gateway"), (b":path", b"/v1/chat/completions"),
            (b":method", b"POST"), (b":scheme", b"http"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-forwarded-proto", b"http"),
            (b"x-request-id", b"6f2b1c9e-5d4a-4c4b-9a0e-1f2e3d4c5b6a")]
        self.buffers[REQUEST_BODY] = payload
        self.properties["xds.cluster_name"] = b"inference_pool"
        spent = {}

        def run(export, *args):
            spent[export] = self.run(export, *args)[1]

        run("proxy_on_context_create", ctx, ROOT)
        run("proxy_on_request_headers", ctx, len(self.maps[REQUEST_HEADERS]), 0)
        run("proxy_on_request_body", ctx, len(payload), 1)
        chosen = dict(self.maps[REQUEST_HEADERS]).get(b"x-gateway-destination-endpoint", b"")
        self.properties["upstream.address"] = chosen.split(b",")[0] or b"127.0.0.1:8001"
        self.maps[RESPONSE_HEADERS] = [(b":status", b"200"),
                                       (b"content-type", b"application/json"),
                                       (b"content-length", str(len(RESPONSE)).encode())]
        self.buffers[RESPONSE_BODY] = RESPONSE
        run("proxy_on_response_headers", ctx, len(self.maps[RESPONSE_HEADERS]), 0)
        run("proxy_on_response_body", ctx, len(RESPONSE), 1)
        run("proxy_on_log", ctx)
        run("proxy_on_done", ctx)
        run("proxy_on_delete", ctx)
        return spent, bool(chosen)


def precise_feed(args, sizes):
    """The change feed's answers for `--precise`: the whole index (epoch 1, version 1), in which
    endpoint g mod hosts holds the keys group g's bodies share at every size, and the answer with
    no change to a filter at that version."""
    endpoints = ["127.0.0.1:%d" % (8001 + i) for i in range(args.hosts)]
    changes = []
    with tempfile.TemporaryDirectory() as tmp:
        request = os.path.join(tmp, "request.json")
        for size in sizes:
            shared = {}
            for i in range(128):
                with open(request, "wb") as f:
                    f.write(body(i, size))
                out = subprocess.run([args.bench, "keys", "--chat-template", args.chat_template,
                                      "--request", request], check=True, capture_output=True)
                keys = [int(k, 16) for k in json.loads(out.stdout)["keys"]]
                group = shared.setdefault(i % 16, keys)
                while group and keys[:len(group)] != group:
                    group.pop()
            for g, keys in shared.items():
                changes += [[g % args.hosts, 1, k] for k in keys]

    def answer(full, changes):
        return json.dumps({"epoch": 1, "version": 1, "full": full, "endpoints": endpoints,
                           "stale": [], "changes": changes}).encode()
    return {"whole index": answer(True, changes), "no change": answer(False, [])}


def started(args, size):
    """A VM configured, past the warm-up (ten polls) and with every body seen: the common path.
    Returns it and the next context id."""
    host = Host(args.wasm, fuel=not args.perf, hosts=args.hosts)
    host.run("proxy_on_context_create", ROOT, 0)
    host.run("proxy_on_vm_start", ROOT, 0)
    if host.run("proxy_on_configure", ROOT, len(CONFIG))[0] != 1:
        sys.exit("the filter refused the config")
    ctx = ROOT + 1
    for _ in range(24):
        host.tick()
        for _ in range(16):
            host.request(ctx, body(ctx, size))
            ctx += 1
    host.calls.clear()
    return host, ctx


def print_calls(host, n, per):
    print(f"  host calls per {per}:")
    for name, count in sorted(host.calls.items()):
        print(f"    {name:40} {count / n:6.2f}")


def requests(args, size):
    host, ctx = started(args, size)
    totals = dict.fromkeys(CALLBACKS, 0)
    routed = 0
    for i in range(args.requests):
        if i % 100 == 0:
            # The polls go on (a stale snapshot is a fallback), uncounted.
            calls = dict(host.calls)
            host.tick()
            host.calls = calls
        spent, chosen = host.request(ctx, body(ctx, size))
        for export, n in spent.items():
            totals[export] += n
        routed += chosen
        ctx += 1
    n = args.requests
    print(f"\n{size} B prompts, {n} requests after the warm-up ({routed} routed):")
    if not args.perf:
        print("  wasm instructions per request (wasmtime fuel), by callback:")
        for export, spent in totals.items():
            print(f"    {export:28} {spent / n:9.0f}")
        print(f"    {'all':28} {sum(totals.values()) / n:9.0f}")
    print_calls(host, n, "request")
    if args.precise:
        host.tick()
        engine = host.metrics.get("kvroute.routed.engine", 0)
        routed = sum(v for k, v in host.metrics.items() if k.startswith("kvroute.routed."))
        print(f"  decided by the engine index: {engine} of {routed} requests routed since start")


def ticks(args):
    """Idle ticks every 100 ms; this VM holds the poll lease, so it polls every
    `stats_interval_ms`."""
    host, _ = started(args, 1024)
    n = args.ticks
    spent = answers = rounds = 0
    for _ in range(n):
        tick, answered = host.tick(ms=100)
        spent += tick
        answers += answered
        rounds += answered > 0
    print(f"\n{n} idle ticks, 100 ms apart, {args.hosts} endpoints ({rounds} poll rounds):")
    if not args.perf:
        print(f"  wasm instructions per tick: {spent / n:.0f}; per poll round's answers (the "
              f"admin /clusters and {args.hosts} engines' /metrics): {answers / max(rounds, 1):.0f}")
    print_calls(host, n, "tick")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wasm")
    parser.add_argument("--requests", type=int, default=2000, help="requests counted per size")
    parser.add_argument("--bytes", default="1024,24576", help="prompt sizes, comma-separated")
    parser.add_argument("--hosts", type=int, default=4, help="endpoints in the pool")
    parser.add_argument("--ticks", type=int, default=50, help="idle ticks counted (0: none)")
    parser.add_argument("--perf", action="store_true",
                        help="no fuel; write a perf map of the filter's functions")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="the template of every model: a Jinja file or a tokenizer_config.json")
    parser.add_argument("--conversation", action="store_true",
                        help="multi-turn conversations instead of a system prompt and a question")
    parser.add_argument("--precise", action="store_true",
                        help="precise mode: an indexer's feed holds each group's prefix "
                             "(needs --chat-template)")
    parser.add_argument("--bench", default="target/release/kvroute-bench",
                        help="the kvroute-bench binary that computes the keys for --precise")
    args = parser.parse_args()
    SHAPE["conversation"] = args.conversation
    if args.precise and not args.chat_template:
        sys.exit("--precise needs --chat-template: the feed's keys are over the rendered prompt")
    if args.chat_template:
        global CONFIG
        with open(args.chat_template, encoding="utf-8") as f:
            text = f.read()
        try:
            spec = json.loads(text)
        except ValueError:
            spec = text
        config = json.loads(CONFIG)
        config["chat_template"] = spec
        if args.precise:
            config["index_cluster"] = "kvroute_indexer"
        CONFIG = json.dumps(config).encode()
    sizes = [int(b) for b in args.bytes.split(",") if b]
    if args.precise:
        FEED.update(precise_feed(args, sizes))
    for size in sizes:
        requests(args, size)
    if args.ticks > 0:
        ticks(args)


if __name__ == "__main__":
    main()
