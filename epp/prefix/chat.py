"""A chat request's prompt text, rendered from the model's chat template the way vLLM 0.32 renders it.

vLLM's ``/v1/chat/completions`` (``vllm/renderers/hf.py`` and ``chat_utils.py``, on transformers 5's
``apply_chat_template`` with ``tokenize=False``) does, and so does :func:`render_chat`:

1. **Template.** The request's ``chat_template`` (a template's text, or the name of one of the
   tokenizer's named templates), else the server's (``--chat-template``), else the tokenizer's: a
   named set picks ``tool_use`` when the request has tools and the set has one, else ``default``.
2. **Messages**, rebuilt as vLLM's ``ConversationMessage``: ``role``, ``content``, and only
   ``tool_calls`` (assistant, when not null; an empty list is dropped; each call's ``arguments`` JSON
   string parsed to a dict, ``{}`` when empty or not an object), ``reasoning`` and its old name
   ``reasoning_content`` (assistant), ``tool_call_id`` (tool), ``name`` and ``task`` (strings),
   ``tools`` (developer). Other fields a client sends are not passed to the template.
3. **Content.** A string becomes one text part. A template that iterates over a message's content
   (found in its syntax tree, as vLLM detects it: the "openai" format) gets a list of parts
   ``{"type": "text", "text": ...}`` (a part's extra fields kept); any other template (the "string"
   format) gets the parts' texts joined with ``"\\n"``. Text parts are ``text``, ``input_text``,
   ``output_text`` (their ``text``), ``refusal`` (its ``refusal``) and ``thinking`` (its ``thinking``);
   a part given as a bare string is text. A tool message's text parts are always joined. A system
   message's text part that starts with Claude Code's ``x-anthropic-billing-header`` loses that
   first line. Any other part (an image, audio, embeddings...) makes the prompt multimodal:
   :class:`Unsupported` (the engine adds placeholder tokens and media hashes no text can give).
4. **Developer role.** Unless the template names ``"developer"``, developer messages become system
   messages, and several system messages (or one not first) are merged into one first message,
   their texts joined with a blank line.
5. **Variables.** ``messages``, ``tools`` (each tool as vLLM's pydantic model dumps it:
   ``{"type": "function", "function": {"name", "description", "parameters"[, "strict"]}}``),
   ``documents``, ``add_generation_prompt`` (default true), the tokenizer's special tokens
   (``bos_token``, ``eos_token``...: strings), and of the request's ``chat_template_kwargs`` (merged
   under the request's own ``add_generation_prompt``, ``continue_final_message``, ``documents``,
   ``reasoning_effort`` and ``enable_thinking``, the latter set from ``reasoning_effort`` when given)
   those the template reads or that ``apply_chat_template`` takes; a ``null`` or ``"auto"`` value is
   dropped. ``chat_template`` or ``tokenize`` among the kwargs is vLLM's 400.
6. **Environment.** jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
   ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block that renders
   its body; ``tojson`` keeps non-ASCII and takes ``indent``/``separators``/``sort_keys``;
   ``raise_exception(message)`` and ``strftime_now(format)`` are globals.
7. **continue_final_message**: the last message's content (its last text part) gets a marker
   appended, and the text is cut where the marker is rendered, so the message stays open.

What is not reproduced (the request is then left to the fallback): multimodal content, vLLM's
built-in fallback templates for models that ship none, a processor's own template
(``chat_template.json`` of multimodal models), Mistral's and Harmony's own renderers, and the order of
keys inside a message (only a template that dumps whole messages or tool calls with ``tojson`` sees
it).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

__all__ = ["ChatOptions", "ChatTemplate", "TemplateError", "Unsupported", "render_chat"]


class Unsupported(Exception):
    """A request this module cannot render exactly (multimodal content, no template...)."""


class TemplateError(Exception):
    """The template or the request made the rendering fail (vLLM answers such a request 400)."""


# --- the jinja2 environment (transformers' apply_chat_template) ------------------------------------


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks assistant spans)."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 declares it a mutable class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()

# apply_chat_template's own parameters (transformers 5): accepted from chat_template_kwargs even when
# the template does not read them; they are consumed by it, never passed to the template.
_APPLY_PARAMETERS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# --- content-format detection (vLLM's _detect_content_format) --------------------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _accesses(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or ``name.key``), possibly through a filter, a test or a slice."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (``{% set msgs = messages[1:] %}``), transitively."""
    found = [name]
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and _accesses(assign.node, current):
                found.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return found


def _message_loop_targets(root: jinja2.nodes.Template) -> list[str]:
    names = _aliases(root, "messages")
    targets = []
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_accesses(loop.iter, n) for n in names):
            targets.append(loop.target.name)
    return targets


def _iterates_content(root: jinja2.nodes.Template) -> bool:
    """Whether a loop iterates over a message's content (directly, through a macro parameter bound to
    it, or over a variable named ``content`` outside macros): vLLM's "openai" content format."""
    messages = _message_loop_targets(root)
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_accesses(arg, m, "content") for m in messages):
                    bound.add(params[i])
            for kwarg in call.kwargs:
                if kwarg.key in params and any(_accesses(kwarg.value, m, "content") for m in messages):
                    bound.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if bound:
                by_loop[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, m, "content") for m in messages):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in by_loop.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@dataclass(frozen=True, slots=True)
class _Compiled:
    template: jinja2.Template
    variables: frozenset[str]
    openai_content: bool
    names_developer: bool


@lru_cache(maxsize=32)  # requests may carry their own template: bounded, as vLLM bounds its caches
def _compile(source: str) -> _Compiled:
    try:
        template = _ENV.from_string(source)
        tree = _ENV.parse(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc
    return _Compiled(
        template,
        frozenset(jinja2.meta.find_undeclared_variables(tree)),
        _iterates_content(tree),
        '"developer"' in source or "'developer'" in source,
    )


# --- the template set of a model -------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template(s) and special tokens, as its tokenizer files give them.

    ``templates``: one template (``{"default": text}``) or a named set; ``special_tokens``: the
    template variables ``bos_token``, ``eos_token``... (strings); ``server_template``: what vLLM's
    ``--chat-template`` would give (it wins over the tokenizer's own).
    """

    templates: Mapping[str, str]
    special_tokens: Mapping[str, str]
    server_template: str | None = None

    def resolve(self, requested: str | None, has_tools: bool) -> str:
        """The template text a request renders with (see the module docstring, step 1)."""
        named = len(self.templates) > 1 or "default" not in self.templates
        if requested is not None:
            return self.templates.get(requested, requested) if named else requested
        if self.server_template is not None:
            return self.templates.get(self.server_template, self.server_template) if named else self.server_template
        if not self.templates:
            raise Unsupported("the model's tokenizer files have no chat template")
        if not named:
            return self.templates["default"]
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise TemplateError(f"the model has several chat templates and no default: {sorted(self.templates)}")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What of a chat request, besides its messages, changes the rendered prompt."""

    tools: list[Any] | None = None
    documents: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None


_TEXT_FIELD = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
}  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
# The content-part fields vLLM's request types declare: any other field of a text part is kept and
# passed to an "openai"-format template.
_KNOWN_PART_FIELDS = frozenset({
    "type", "text", "refusal", "thinking", "closed", "image_url", "input_audio", "audio_url", "video_url",
    "image_embeds", "audio_embeds", "video_embeds", "image_pil", "uuid", "data", "name", "file",
})  # fmt: skip


def _text_parts(role: str, content: Any) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(text, the part's extra fields) of each text part; Unsupported for any other part."""
    if content is None:
        return
    if isinstance(content, str):
        content = [content]
    if not isinstance(content, list):
        raise Unsupported(f"content of a {role} message is {type(content).__name__}")
    for part in content:
        if isinstance(part, str):
            text, extra = part, None
        elif isinstance(part, dict):
            kind = part.get("type")
            field = _TEXT_FIELD.get(kind) if isinstance(kind, str) else None
            if field is None:
                raise Unsupported(f"content part of type {kind!r} (multimodal or unknown)")
            value = part.get(field)
            if value is None and kind in ("text", "refusal"):
                continue  # vLLM skips such parts
            if not isinstance(value, str):
                raise Unsupported(f"{kind} content part without a string {field}")
            text, extra = value, {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS} or None
        else:
            raise Unsupported(f"content part is {type(part).__name__}")
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        yield text, extra


def _content(role: str, content: Any, openai: bool) -> str | list[dict[str, Any]]:
    parts = list(_text_parts(role, content))
    if openai and role != "tool":
        return [{"type": "text", "text": t, **(extra or {})} for t, extra in parts]
    return "\n".join(t for t, _ in parts)


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise Unsupported("tool_calls is not a list")
    if not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise TemplateError("chat completions only support assistant tool_calls of type 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            raise TemplateError("chat completions only support assistant tool_calls of type 'function'")
        arguments = function.get("arguments")
        if not arguments:
            parsed: Any = {}
        elif isinstance(arguments, dict):
            parsed = arguments
        elif isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = {}  # vLLM coerces bad JSON to {} so that a conversation can go on
        else:
            parsed = arguments
        out.append({**call, "function": {**function, "arguments": parsed if isinstance(parsed, dict) else {}}})
    return out


def _conversation(messages: Sequence[Any], openai: bool) -> list[dict[str, Any]]:
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unsupported("a message is not an object with a string role")
        role = message["role"]
        out: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), openai)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                calls = _tool_calls(calls)
                if calls is not None:
                    out["tool_calls"] = calls
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        if role == "developer":
            out["tools"] = message.get("tools")
        conversation.append(out)
    return conversation


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"} | {"role": "system"}
        converted.append(message)
    texts: list[str] = []
    others = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *others] if merge else converted


def _tool_dict(tool: Any) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it to the template."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise Unsupported("a tool is not an object with a function")
    function = tool["function"]
    if not isinstance(function.get("name"), str):
        raise Unsupported("a tool function has no name")
    dumped: dict[str, Any] = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        value = function.get(key, tool.get(key) if key == "defer_loading" else None)
        if value is not None:
            dumped[key] = value
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _kwargs(options: ChatOptions) -> dict[str, Any]:
    """vLLM's merged chat-template kwargs: the request's, under its own fields; null/"auto" dropped."""
    user = dict(options.chat_template_kwargs or {})
    unexpected = {"chat_template", "tokenize"} & user.keys()
    if unexpected:
        raise TemplateError(f"Found unexpected chat template kwargs from request: {unexpected}")
    extra: dict[str, Any] = {
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final_message,
        "documents": options.documents,
        "reasoning_effort": options.reasoning_effort,
    }
    if options.reasoning_effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = options.reasoning_effort != "none"
    merged = user | {k: v for k, v in extra.items() if v is not None and v != "auto"}
    return {k: v for k, v in merged.items() if v is not None and v != "auto"}


def render_chat(template: ChatTemplate, messages: Sequence[Any], options: ChatOptions = ChatOptions()) -> str:
    """The prompt text vLLM renders for ``messages`` (raw JSON values) under ``options``.

    Raises :class:`Unsupported` for what is not reproduced here and :class:`TemplateError` where
    vLLM fails the request.
    """
    if not messages:
        raise TemplateError("Cannot apply chat template to an empty conversation.")
    if options.continue_final_message and options.add_generation_prompt:
        raise TemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    tools = None if options.tools is None else [_tool_dict(t) for t in options.tools]
    kwargs = _kwargs(options)
    if "tools" in kwargs:  # chat_template_kwargs may carry the tools itself: it wins
        tools = kwargs.pop("tools")
    source = template.resolve(options.chat_template, tools is not None)
    compiled = _compile(source)
    conversation = _conversation(messages, compiled.openai_content)
    if not compiled.names_developer and any(m["role"] == "developer" for m in conversation):
        conversation = _developer_to_system(conversation)
    continuing = bool(kwargs.pop("continue_final_message", False))
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
    documents = kwargs.pop("documents", None)
    variables = {k: v for k, v in kwargs.items() if k in compiled.variables and k not in _APPLY_PARAMETERS}
    final = ""
    if continuing:
        final = _mark_final(conversation, source)
    try:
        text = compiled.template.render(
            {**template.special_tokens, **variables, "messages": conversation, "tools": tools,
             "documents": documents, "add_generation_prompt": add_generation_prompt}
        )  # fmt: skip
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from exc
    except Exception as exc:  # a template can fail any way a Python expression can
        raise TemplateError(f"chat template failed: {exc!r}") from exc
    return _cut_final(text, final) if continuing else text


def _mark_final(conversation: list[dict[str, Any]], source: str) -> str:
    """Append transformers' marker to the last message's content; the text it marks."""
    if "content" not in source:
        raise TemplateError('continue_final_message is set to "content" but this is not an accepted field')
    last = conversation[-1] = dict(conversation[-1])
    content = last.get("content")
    if isinstance(content, list):
        parts = last["content"] = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = str(part["text"])
                part["text"] = final + _CONTINUE_TAG
                return final
        raise TemplateError("continue_final_message is set but the final message has no text to continue")
    if content is None:
        raise TemplateError('continue_final_message is set but the final message has no "content" to continue')
    last["content"] = str(content) + _CONTINUE_TAG
    return str(content)


def _cut_final(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateError("continue_final_message is set but the final message does not appear in the chat")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
