"""Checks a KV event batch (kvroute-sim's) against vLLM's own classes and key functions.

Usage: check-kv-event.py SALT < PAYLOAD   (run with the vLLM venv's python)
PAYLOAD is one message's msgpack payload whose first event is the BlockStored of a prompt's
first blocks sent with `cache_salt` SALT. The payload must decode as vLLM's `KVEventBatch`, encode
back to the same bytes, and the event's `extra_keys` must be what vLLM publishes for such a prompt:
`to_event_extra_keys` over `generate_block_hash_extra_keys` of every block. Prints one JSON line,
{"ok": true} or {"ok": false, "why": ...}, and exits 0 or 1.
"""

import json
import sys
from types import SimpleNamespace

import msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    to_event_extra_keys,
)


def check(payload, salt):
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    if msgspec.msgpack.encode(batch) != payload:
        return "vLLM's KVEventBatch encodes the decoded batch to other bytes"
    event = batch.events[0]
    if not isinstance(event, BlockStored) or event.parent_block_hash is not None:
        return f"the first event is not a prompt's first BlockStored: {event!r}"
    # What vLLM's block pool publishes for the same blocks of a request with this salt.
    request = SimpleNamespace(
        cache_salt=salt, mm_features=None, lora_request=None, prompt_embeds=None
    )
    size = event.block_size
    keys = [
        generate_block_hash_extra_keys(request, i * size, (i + 1) * size, 0)[0]
        for i in range(len(event.block_hashes))
    ]
    want = to_event_extra_keys(keys)
    if event.extra_keys != want:
        return f"extra_keys {event.extra_keys!r}, vLLM publishes {want!r}"
    return None


def main():
    why = check(sys.stdin.buffer.read(), sys.argv[1])
    print(json.dumps({"ok": why is None, "why": why}), flush=True)
    sys.exit(0 if why is None else 1)


if __name__ == "__main__":
    main()
