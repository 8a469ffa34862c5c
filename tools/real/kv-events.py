"""Subscribes to a ZMQ KV event endpoint (vLLM's or kvroute-sim's) for a while and prints every
message as one JSON line: {"frames": n, "topic": ..., "seq": ..., "batch": <decoded msgpack>}.

Usage: kv-events.py ENDPOINT SECONDS   (run with the vLLM venv's python: pyzmq and msgspec)
It stops early at an AllBlocksCleared event that follows a BlockRemoved one (a reset after an
eviction ends what a test sends).
"""

import json
import sys
import time

import msgspec
import zmq


def main():
    endpoint, seconds = sys.argv[1], float(sys.argv[2])
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    print(json.dumps({"subscribed": endpoint}), flush=True)
    deadline = time.time() + seconds
    removed = False
    while time.time() < deadline:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        line = {"frames": len(frames)}
        if len(frames) == 3:
            topic, seq, payload = frames
            line["topic"] = topic.decode(errors="replace")
            line["seq"] = int.from_bytes(seq, "big", signed=True)
            line["batch"] = msgspec.msgpack.decode(payload)
        print(json.dumps(line, default=repr), flush=True)
        text = json.dumps(line.get("batch"), default=repr)
        removed = removed or '"BlockRemoved"' in text
        if removed and '"AllBlocksCleared"' in text:
            break


if __name__ == "__main__":
    main()
