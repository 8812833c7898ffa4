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
"""

from __future__ import annotations

import json
import re
import uuid

from edgebuild.runtime.structured import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
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
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args
                    if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


class ToolStreamFilter:
    """Splits a streamed text into what can be sent as ``content`` now and what is held
    back because it may start a ``<tool_call>`` block (sent, or parsed into tool-call deltas,
    when the choice ends)."""

    def __init__(self):
        self.held = ""
        self.in_call = False

    def feed(self, delta: str) -> str:
        """The part of `delta` (after what was held) that is plain content for sure."""
        text = self.held + delta
        if self.in_call:
            self.held = text
            return ""
        i = text.find(OPEN)
        if i >= 0:
            self.in_call, self.held = True, text[i:]
            return text[:i]
        # keep a tail that could be the start of "<tool_call>"
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-k:]):
                self.held = text[-k:]
                return text[:-k]
        self.held = ""
        return text
