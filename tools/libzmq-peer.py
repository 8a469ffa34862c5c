"""A libzmq SUB and DEALER (pyzmq) on a KV-event publisher: its sockets as a real ZeroMQ peer sees them.

Usage: libzmq-peer.py EVENTS REPLAY TOPIC   (any Python with pyzmq; the SGLang venv has it)
Subscribes to TOPIC on EVENTS and prints {"subscribed": <libzmq version>}. Prints the first message
it receives as {"stream": [frame, ...]}, then asks REPLAY with a DEALER for every message from 0
and prints {"replay": [[frame, ...], ...]}, the end marker last; frames are hex. Exits 1 with
{"error": ...} when nothing arrives within 20 s.
"""

import json
import sys

import zmq

END = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_MS = 20_000


def say(line):
    print(json.dumps(line), flush=True)


def hexed(frames):
    return [f.hex() for f in frames]


def main():
    events, replay, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(events)
    say({"subscribed": zmq.zmq_version()})
    try:
        say({"stream": hexed(sub.recv_multipart())})
    except zmq.Again:
        say({"error": "no message on the stream"})
        sys.exit(1)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    messages = []
    while not messages or messages[-1][2:3] != [END]:
        try:
            messages.append(dealer.recv_multipart())
        except zmq.Again:
            say({"error": f"the replay stopped after {len(messages)} messages"})
            sys.exit(1)
    say({"replay": [hexed(m) for m in messages]})


if __name__ == "__main__":
    main()
