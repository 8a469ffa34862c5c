"""Checks kvroute-sim's replay socket against vLLM's own: the same request gets the same frames.

Usage: check-replay.py ENDPOINT TOPIC   (run with the vLLM venv's python: vLLM and pyzmq)
ENDPOINT is a replica's replay socket (its `kv_events_replay`), TOPIC its `kv_events_topic`; the
replica must have published at least one message, all still buffered. vLLM's ZmqEventPublisher is
started with a replay endpoint (on Unix sockets in a temporary directory) and the same topic, and
publishes two batches. Both replay sockets are asked, by a libzmq DEALER, for their messages from
0: each answer must be `["", topic, seq, payload]` for every message, numbered from 0, then the
end marker `["", "", -1, ""]`, and the sim's payloads must decode as vLLM's KVEventBatch. Prints
one JSON line, {"ok": true, ...} or {"ok": false, "why": ...}, and exits 0 or 1.
"""

import json
import sys
import tempfile
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    KVEventBatch,
    ZmqEventPublisher,
)

END = (-1).to_bytes(8, "big", signed=True)


def replay(endpoint):
    """The messages a DEALER gets for a replay from 0, the end marker last."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    messages = []
    while True:
        frames = sock.recv_multipart()
        messages.append(frames)
        if len(frames) == 4 and frames[2] == END:
            sock.close()
            return messages


def check(messages, topic, who):
    *batches, end = messages
    if end != [b"", b"", END, b""]:
        return f"{who}: the end marker is {end!r}"
    if not batches:
        return f"{who}: no message replayed"
    for n, frames in enumerate(batches):
        if len(frames) != 4 or frames[0] != b"" or frames[1] != topic:
            return f"{who}: message {n} is {frames[:3]!r}"
        if frames[2] != n.to_bytes(8, "big"):
            return f"{who}: message {n} is numbered {frames[2]!r}"
        msgspec.msgpack.decode(frames[3], type=KVEventBatch)
    return None


def main():
    sim, topic = sys.argv[1], sys.argv[2].encode()
    with tempfile.TemporaryDirectory() as tmp:
        publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"ipc://{tmp}/events",
            replay_endpoint=f"ipc://{tmp}/replay",
            topic=topic.decode(),
        )
        for _ in range(2):
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        deadline = time.time() + 10
        while len(replay(f"ipc://{tmp}/replay")) < 3 and time.time() < deadline:
            time.sleep(0.05)
        theirs = replay(f"ipc://{tmp}/replay")
        publisher.shutdown()
    ours = replay(sim)
    why = check(theirs, topic, "vLLM") or check(ours, topic, "kvroute-sim")
    shape = lambda m: [len(f) for f in m]
    print(json.dumps({"ok": why is None, "why": why,
                      "vllm": [shape(m) for m in theirs[-2:]],
                      "sim": [shape(m) for m in ours[-2:]]}))
    sys.exit(0 if why is None else 1)


if __name__ == "__main__":
    main()
