#!/usr/bin/env python3
"""Chat requests rendered as vLLM's chat endpoint renders them, by transformers: the reference the
filter's template rendering (src/template/) is held against in tests/template_conformance.rs.

Each request's messages are prepared as vLLM prepares them (parse_chat_messages: content as one
string or as text parts by what the template loops over, tool results' text parts joined, only the
fields vLLM keeps, tool call arguments parsed from JSON, developer messages as system ones for a
template that does not name the role) and each tool as vLLM's model dumps it, then rendered with
`apply_chat_template(tokenize=False)` of a tokenizer carrying the template and its special tokens.
Media parts are written as the filter writes them (src/template/messages.rs): vLLM's placeholder is
model-specific and the engine keys images by a hash no text carries.

    hf-render.py CASES.json  →  prints [{"text": ...} | {"error": ...}, ...]

CASES.json: [{"template": FILE, "request": {...}}, ...], FILE a raw Jinja template or a
tokenizer_config.json.
"""
import json
import sys

import jinja2
import jinja2.nodes
import xxhash
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

SPECIAL = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
TEXT_TYPES = ("text", "input_text", "output_text")


def load(path):
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    try:
        config = json.loads(raw)
    except ValueError:
        config = None
    if not isinstance(config, dict) or "chat_template" not in config:
        config = {"chat_template": raw}
    source = config["chat_template"]
    if isinstance(source, list):
        named = {t["name"]: t["template"] for t in source}
        source = named.get("default", source[0]["template"])
    tokens = {}
    for key in SPECIAL:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return source, tokens


def content_access(node):
    """Whether a loop's iterable is a message's content: `m['content']`, `m.content`, `content`."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def content_format(source):
    """vLLM's detection: a template that loops over message content gets OpenAI-style parts."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if content_access(loop.iter):
            return "openai"
    return "string"


def media_hash(value):
    if isinstance(value, str):
        return xxhash.xxh3_64_intdigest(value.encode())
    if isinstance(value, dict) and isinstance(value.get("url"), str):
        return xxhash.xxh3_64_intdigest(value["url"].encode())
    return xxhash.xxh3_64_intdigest(json.dumps(value, separators=(", ", ": "), ensure_ascii=False).encode())


def marker(kind, value):
    return f"<|kvroute_{kind}:{media_hash(value):016x}|>"


MEDIA = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "image_embeds": ("image", "image_embeds"),
    "audio_url": ("audio", "audio_url"),
    "video_url": ("video", "video_url"),
    "file": ("file", "file"),
}


def part(p):
    """('text', str) | ('media', kind, marker) | None to skip."""
    if isinstance(p, str):
        return ("text", p)
    kind = p.get("type")
    if kind in TEXT_TYPES or kind == "refusal":
        text = p.get("refusal" if kind == "refusal" else "text")
        return None if text is None else ("text", text)
    if kind == "thinking":
        return ("text", p.get("thinking"))
    if kind == "input_audio":
        return ("media", "audio", marker("audio", (p.get("input_audio") or {}).get("data")))
    if kind in MEDIA:
        modality, field = MEDIA[kind]
        return ("media", modality, marker(modality, p.get(field)))
    raise ValueError(f"unsupported content part {kind!r}")


def prepare(message, fmt):
    role = message["role"]
    content = message.get("content")
    parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
    texts, markers, out = [], [], []
    for p in parts:
        parsed = part(p)
        if parsed is None:
            continue
        if parsed[0] == "text":
            texts.append(parsed[1])
            out.append({"type": "text", "text": parsed[1]})
        else:
            markers.append(parsed[2])
            out.append({"type": parsed[1]})
            out.append({"type": "text", "text": parsed[2]})
    if fmt == "openai":
        result = {"role": role, "content": out}
    else:
        text = "\n".join(texts)
        result = {"role": role, "content": "\n".join(markers + [text]) if text or not markers else "\n".join(markers)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = list(message["tool_calls"])
        if message.get("reasoning") is not None:
            result["reasoning"] = message["reasoning"]
            result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list) and all(i.get("type") == "text" for i in result["content"]):
            result["content"] = "\n".join(i.get("text", "") for i in result["content"])
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def postprocess(conversation):
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        calls = message["tool_calls"]
        if len(calls) == 0:
            message.pop("tool_calls")
            continue
        for call in calls:
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    call["function"]["arguments"] = {}
            elif not isinstance(arguments, (dict, list)):
                call["function"]["arguments"] = {}


def vllm_tool(tool):
    """A tool as vLLM passes it: validated as ChatCompletionToolsParam and dumped back."""
    if not isinstance(tool, dict) or tool.get("type", "function") not in ("function", None):
        raise ValueError("a tool vLLM refuses")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("a tool vLLM refuses")
    dumped = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    defer = function.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        dumped["defer_loading"] = defer
    out = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def text_of(content):
    if isinstance(content, list):
        return "\n".join(p["text"] if isinstance(p, dict) else p for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
    return content or ""


def developer_as_system(conversation, source):
    """vLLM's conversion for a template that does not name the developer role."""
    if '"developer"' in source or "'developer'" in source or not any(m["role"] == "developer" for m in conversation):
        return conversation
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = dict(m, role="system")
            m.pop("tools", None)
        converted.append(m)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if len(systems) < 2 and all(i == 0 for i in systems):
        return converted
    texts = [t for t in (text_of(converted[i].get("content", "")) for i in systems) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in converted if m["role"] != "system"]


def render(tokenizers, case):
    if case["template"] not in tokenizers:
        source, tokens = load(case["template"])
        backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=source, **tokens)
        tokenizers[case["template"]] = (tokenizer, content_format(source), source)
    tokenizer, fmt, source = tokenizers[case["template"]]
    request = case["request"]
    conversation = [prepare(m, fmt) for m in request["messages"]]
    postprocess(conversation)
    conversation = developer_as_system(conversation, source)
    tools = request.get("tools")
    if tools is not None:
        tools = [vllm_tool(t) for t in tools]
    kwargs = dict(request.get("chat_template_kwargs") or {})
    return tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        documents=request.get("documents"),
        add_generation_prompt=request.get("add_generation_prompt", True),
        continue_final_message=request.get("continue_final_message", False),
        tokenize=False,
        **kwargs,
    )


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    tokenizers = {}
    out = []
    for case in cases:
        try:
            out.append({"text": render(tokenizers, case)})
        except Exception as e:  # noqa: BLE001 - a template's own exception is a result here
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
