#!/usr/bin/env python3
"""SGLang's own KV-event classes and publisher, driven over stdin/stdout for the indexer's
conformance test (indexer/tests/sglang_conformance.rs).

Loads sglang.srt.disaggregation.kv_events from the installed `sglang` package without the
package's __init__ (which needs torch and a GPU stack): the parent packages are registered as
bare namespaces over their folders, so only the events module and the few modules it imports
run. Then it answers one JSON command per stdin line with one JSON line on stdout:

  {"encode": [EVENT, ...]}            -> {"payload": HEX}: a KVEventBatch as SGLang encodes it
  {"decode": HEX}                     -> {"events": [EVENT, ...], "attn_dp_rank": R} or
                                         {"error": MESSAGE}: a payload read as SGLang's typed
                                         KVEventBatch (msgspec checks every field's type)
  {"publishers": N, "topic": T}       -> {"ranks": [{"endpoint", "replay_endpoint", ..}, ..]}:
                                         N ZmqEventPublisher ranks on 127.0.0.1, each with a
                                         replay socket, on base ports SGLang offsets by the rank
  {"publish": [EVENT, ...], "rank": R} -> {"published": R}

EVENT is {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", "medium"?, "cache_salt"?}, {"type": "BlockRemoved", "block_hashes", "medium"?} or
{"type": "AllBlocksCleared"}. The first line out is {"sglang": VERSION}, or {"unavailable":
REASON} (exit status 3) when the package cannot be loaded. Ends at stdin's end.
"""

import importlib.metadata
import importlib.util
import json
import os
import random
import sys
import time
import types


def load_events_module():
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ImportError("the sglang package is not installed")
    root = os.path.dirname(spec.origin)
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation",
                 "sglang.srt.arg_groups"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[name] = package
    import sglang.srt.disaggregation.kv_events as kv_events
    return kv_events


def build(kv, event):
    kind = event["type"]
    if kind == "BlockStored":
        optional = {k: event[k] for k in ("medium", "cache_salt") if k in event}
        return kv.BlockStored(block_hashes=event["block_hashes"],
                              parent_block_hash=event.get("parent_block_hash"),
                              token_ids=event["token_ids"], block_size=event["block_size"],
                              lora_id=None, **optional)
    if kind == "BlockRemoved":
        optional = {k: event[k] for k in ("medium",) if k in event}
        return kv.BlockRemoved(block_hashes=event["block_hashes"], **optional)
    if kind == "AllBlocksCleared":
        return kv.AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


def batch(kv, events):
    return kv.KVEventBatch(ts=time.time(), events=[build(kv, e) for e in events])


def start_publishers(kv, ranks, topic):
    """`ranks` publishers on 127.0.0.1 from a free base port (replay sockets from another),
    rank r on base + r as SGLang's offset_endpoint_port makes it."""
    import zmq

    for _ in range(50):
        base = random.randrange(20000, 60000, 2 * ranks)
        started = []
        try:
            for rank in range(ranks):
                started.append(kv.ZmqEventPublisher(
                    attn_dp_rank=rank, endpoint=f"tcp://127.0.0.1:{base}",
                    replay_endpoint=f"tcp://127.0.0.1:{base + ranks}", topic=topic, bind=True))
            return started
        except zmq.ZMQError:
            for publisher in started:
                publisher.shutdown()
    raise RuntimeError("no free ports for the publishers")


def main():
    try:
        kv = load_events_module()
        import msgspec
    except Exception as e:  # noqa: BLE001 - any failure to load means the package is unusable
        print(json.dumps({"unavailable": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(3)
    print(json.dumps({"sglang": importlib.metadata.version("sglang")}), flush=True)
    encoder = msgspec.msgpack.Encoder()
    publishers = []
    for line in sys.stdin:
        command = json.loads(line)
        if "encode" in command:
            answer = {"payload": encoder.encode(batch(kv, command["encode"])).hex()}
        elif "decode" in command:
            try:
                decoded = msgspec.msgpack.decode(bytes.fromhex(command["decode"]),
                                                 type=kv.KVEventBatch)
                answer = {"events": [dict(msgspec.to_builtins(e), type=type(e).__name__)
                                     for e in decoded.events],
                          "attn_dp_rank": decoded.attn_dp_rank}
            except msgspec.ValidationError as e:
                answer = {"error": str(e)}
        elif "publishers" in command:
            publishers = start_publishers(kv, command["publishers"], command.get("topic", ""))
            answer = {"ranks": [p.describe_local_source(block_size=1) for p in publishers]}
        elif "publish" in command:
            publishers[command["rank"]].publish(batch(kv, command["publish"]))
            answer = {"published": command["rank"]}
        else:
            raise ValueError(f"unknown command {command!r}")
        print(json.dumps(answer), flush=True)
    for publisher in publishers:
        publisher.shutdown()


if __name__ == "__main__":
    main()
