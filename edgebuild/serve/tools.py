"""Tool calling: tools into the prompt, ``<tool_call>`` blocks out of the text (Hermes / Qwen).

Prompt. A chat template that handles ``tools`` (Qwen2.5, Hermes, Llama 3.1 ...) renders them
itself (``apply_chat_template(tools=...)``), with assistant ``tool_calls`` and ``role: "tool"``
results in its own format. A template without tool support (SmolLM2's) gets the Hermes
convention that Qwen's template writes: a system message listing the tools as JSON inside
``<tools></tools>`` and asking for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
earlier assistant calls are written back as those blocks and tool results as
``<tool_response>`` blocks.

Output. ``<tool_call>`` blocks holding ``{"name", "arguments"}`` JSON become
``message.tool_calls`` (``arguments`` as a JSON string, OpenAI's shape), the text around
them ``content`` (None when empty), and ``finish_reason`` is ``tool_calls``. With
``tool_choice`` ``required`` or a named function, the output is forced through the
structured-output path (:mod:`edgebuild.runtime.structured`, kind ``tool_call``): one block
whose JSON matches the named function's (or any tool's) ``name`` and ``parameters``.
``arguments`` is the arguments object's text as the model wrote it (JSON re-encoded only when
the block is not laid out ``{"name": ..., "arguments": {...}}``).

Streaming (:class:`ToolCallStream`), as OpenAI streams calls: a call's first delta carries its
``index``, ``id``, ``type`` and ``name`` as soon as the block's name is complete, then each new
piece of the arguments' text goes out as it is generated, so the pieces concatenate to the
non-streamed ``arguments``. Where the two can differ: a block whose name was streamed but
that then never parses (malformed JSON, or cut by ``max_tokens`` before ``</tool_call>``)
stays a (broken) call in the stream, while the non-streamed answer keeps it as content.
A forced call (``tool_choice`` required or named) cut by ``max_tokens`` before it parses is
not content in either: the answer has no content and no calls, with ``finish_reason``
``length`` (the partial ``<tool_call>`` markup is dropped).
"""

from __future__ import annotations

import json
import re
import uuid

from edgebuild.runtime.structured import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# a block's head up to its arguments' value: {"name": "<name>", "arguments": (or "parameters")
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_DECODER = json.JSONDecoder()
SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders ``tools`` itself."""
    return bool(chat_template) and "tools" in chat_template


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` for a template without tool support: the tools in a system message (after
    the client's own system message, if any), calls and results as Hermes text blocks."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    prompt = SYSTEM.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_json(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name"), "arguments": args}


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` as HF chat templates expect them (``arguments`` a dict)."""
    out = []
    for c in calls:
        call = _call_json(c)
        out.append({"type": "function", "id": c.get("id"), "function": call})
    return out


def forced_grammar(tools: list[dict], name: str | None) -> GrammarSpec:
    """The structured output of ``tool_choice`` required (any tool) or a named function: one
    ``<tool_call>`` block whose JSON is ``{"name": <name>, "arguments": <its parameters>}``."""
    options = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return GrammarSpec("tool_call", json.dumps(schema))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completed output: the ``<tool_call>`` blocks that hold a
    JSON object with a string ``name`` become calls (ids ``call_<hex>``); a block that does
    not parse stays in the content as text."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[last : m.start()])
        last = m.end()
        raw = raw_arguments(m.group(1))
        if raw is None:
            raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": _call_id(),
                "type": "function",
                "function": {"name": obj["name"], "arguments": raw},
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def raw_arguments(block: str, start: int | None = None) -> str | None:
    """The arguments object's text as written in a ``{"name": ..., "arguments": {...}}``
    block (``start``: where the value begins, else found by the head), or None when the
    block is not laid out so or the object is not complete."""
    if start is None:
        m = _HEAD.match(block)
        if m is None:
            return None
        start = m.end()
    if not block.startswith("{", start):
        return None
    try:
        value, end = _DECODER.raw_decode(block, start)
    except json.JSONDecodeError:
        return None
    return block[start:end] if isinstance(value, dict) else None


def tool_call_deltas(calls: list[dict], first: int = 0) -> list[dict]:
    """OpenAI's streamed tool-call deltas of complete `calls` (indices from ``first``): per
    call, one delta with its index, id, type and name (empty arguments), then one with the
    arguments."""
    out = []
    for k, c in enumerate(calls, start=first):
        head = {"name": c["function"]["name"], "arguments": ""}
        out.append({"index": k, "id": c["id"], "type": "function", "function": head})
        out.append({"index": k, "function": {"arguments": c["function"]["arguments"]}})
    return out


class ToolCallStream:
    """One streamed choice's text as ordered pieces: ``{"content": text}`` for plain text
    (a tail that may start ``<tool_call>`` is held back) and ``{"tool_calls": [deltas]}``
    for its calls, the arguments sent piece by piece as they are generated (module
    docstring)."""

    def __init__(self, forced: bool = False):
        self.forced = forced  # tool_choice required / named: the text is one call, no content
        self.buf = ""  # text not classified yet (inside a call: the block so far)
        self.in_call = False
        self.calls = 0  # calls started (the next call's index)
        self.head = False  # the current call's name delta was sent
        self.args_at = 0  # where its arguments' value starts in the block
        self.args_sent = 0  # characters of its arguments sent
        self.args_done = False  # its arguments object is complete

    def feed(self, delta: str) -> list[dict]:
        """The pieces that `delta` (after what was held) makes certain."""
        self.buf += delta
        out: list[dict] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _open_tail(self.buf)
                    _add_content(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                _add_content(out, self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(OPEN) :], True
                self.head, self.args_sent, self.args_done = False, 0, False
            j = self.buf.find(CLOSE)
            self._block(out, self.buf if j < 0 else self.buf[:j], closed=j >= 0)
            if j < 0:
                return out
            self.buf, self.in_call = self.buf[j + len(CLOSE) :], False

    def finish(self) -> list[dict]:
        """The pieces left when the choice ends: the held tail, or an unclosed block whose
        call never started (as content; none for a forced call cut by ``max_tokens``); a
        started call was already streamed."""
        text = self.buf if not self.in_call else ("" if self.head else OPEN + self.buf)
        if self.forced:
            text = ""  # only the (cut) call's markup: not content
        self.buf, self.in_call = "", False
        out: list[dict] = []
        _add_content(out, text)
        return out

    def _block(self, out: list[dict], block: str, closed: bool) -> None:
        """The deltas of the current block so far (``closed``: it is complete)."""
        if not self.head:
            m = _HEAD.match(block)
            if m is None or m.end() == len(block):  # no head yet (or its value not begun)
                if closed:
                    self._whole_block(out, block)
                return
            head = {"name": json.loads(m.group(1)), "arguments": ""}
            call = {"index": self.calls, "id": _call_id(), "type": "function", "function": head}
            out.append({"tool_calls": [call]})
            self.head, self.args_at, self.calls = True, m.end(), self.calls + 1
        if self.args_done:
            return
        raw = raw_arguments(block, self.args_at)
        if raw is None and not block.startswith("{", self.args_at):
            if closed:  # arguments given as a JSON string: its value, whole
                _, calls = parse_tool_calls(OPEN + block + CLOSE)
                raw = calls[0]["function"]["arguments"] if calls else ""
            else:
                return
        self.args_done = raw is not None
        text = raw if raw is not None else block[self.args_at :]  # incomplete: all of it
        if len(text) > self.args_sent:
            piece = {"index": self.calls - 1, "function": {"arguments": text[self.args_sent :]}}
            out.append({"tool_calls": [piece]})
            self.args_sent = len(text)

    def _whole_block(self, out: list[dict], block: str) -> None:
        """A closed block without the streamable head: its call whole, or content."""
        _, calls = parse_tool_calls(OPEN + block + CLOSE)
        if calls:
            out.append({"tool_calls": tool_call_deltas(calls, self.calls)})
            self.calls += len(calls)
        else:
            _add_content(out, OPEN + block + CLOSE)


def _add_content(out: list[dict], text: str) -> None:
    """Append `text` as content (joined to a content piece just before it)."""
    if text and out and "content" in out[-1]:
        out[-1] = {"content": out[-1]["content"] + text}
    elif text:
        out.append({"content": text})


def _open_tail(text: str) -> int:
    """Length of the longest tail of `text` that could begin ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
