"""epp.prefix.chat: the chat template rendered as vLLM 0.32 renders it (the tier checks the ids against
real vLLM; these tests pin each rule on its own)."""

from __future__ import annotations

import json

import pytest

from epp.prefix.chat import ChatOptions, ChatTemplate, TemplateError, Unsupported, render_chat
from epp.testing.tokenizer import TEMPLATES

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def _render(template: str, messages: list, **options: object) -> str:
    return render_chat(ChatTemplate({"default": template}, SPECIALS), messages, ChatOptions(**options))  # type: ignore[arg-type]


# A template that shows what the template is given.
DUMP = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ add_generation_prompt }}"
DUMP_PARTS = "{% for m in messages %}{% for p in m.content %}[{{ p | tojson }}]{% endfor %}\n{% endfor %}"


def _dumped(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_string_content_format_joins_text_parts_with_newlines() -> None:
    out = _dumped(_render(DUMP, [{"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                                                              {"type": "input_text", "text": "c"},
                                                              {"type": "text", "text": None}]}]))  # fmt: skip
    assert out == [{"role": "user", "content": "a\nb\nc"}]


def test_a_template_iterating_content_gets_parts_even_for_string_content() -> None:
    text = _render(DUMP_PARTS, [{"role": "user", "content": "hi"},
                                {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"t": 1}}]}])
    # (trim_blocks, as transformers sets it, eats the newline after a block tag)
    assert text == '[{"type": "text", "text": "hi"}][{"type": "text", "text": "x", "cache_control": {"t": 1}}]'


def test_only_the_fields_vllm_keeps_reach_the_template() -> None:
    messages = [
        {"role": "system", "content": "s", "extra": 1},
        {"role": "assistant", "content": None, "reasoning_content": "why", "name": "bot", "weight": 2,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}},
                        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    ]  # fmt: skip
    out = _dumped(_render(DUMP, messages))
    assert out[0] == {"role": "system", "content": "s"}
    assert out[1]["reasoning"] == out[1]["reasoning_content"] == "why" and out[1]["name"] == "bot"
    assert "weight" not in out[1] and out[1]["content"] == ""
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"b": 1, "a": 2}, {}]
    assert "tool_calls" not in out[2]
    assert out[3] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}


def test_developer_messages_become_one_first_system_message_unless_the_template_names_them() -> None:
    messages = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d", "tools": [1]},
                {"role": "system", "content": "s"}]  # fmt: skip
    assert _dumped(_render(DUMP, messages))[:2] == [{"role": "system", "content": "d\n\ns"}, {"role": "user", "content": "u"}]
    naming = DUMP + "{# 'developer' #}"
    assert _dumped(_render(naming, messages))[1] == {"role": "developer", "content": "d", "tools": [1]}


def test_tools_are_dumped_as_vllms_model_and_tojson_keeps_unicode() -> None:
    template = "{{ tools | tojson }}|{{ 'é<>' | tojson }}"
    text = _render(template, [{"role": "user", "content": "x"}],
                   tools=[{"type": "function", "function": {"name": "f", "extra": 1}, "other": 2}])
    assert text == '[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]|"é<>"'


def test_kwargs_reach_the_template_and_the_requests_own_fields_win() -> None:
    template = "{{ flavour }}-{{ add_generation_prompt }}-{{ enable_thinking }}-{{ padding is defined }}"
    text = _render(template, [{"role": "user", "content": "x"}], reasoning_effort="none",
                   chat_template_kwargs={"flavour": "salt", "add_generation_prompt": False, "padding": True})
    assert text == "salt-True-False-False"  # padding is apply_chat_template's own: never the template's
    with pytest.raises(TemplateError, match="unexpected"):
        _render(template, [{"role": "user", "content": "x"}], chat_template_kwargs={"tokenize": True})
    dropped = _render("{{ flavour }}", [{"role": "user", "content": "x"}], chat_template_kwargs={"flavour": "auto"})
    assert dropped == ""


def test_special_tokens_are_variables_and_bos_is_written_by_the_template() -> None:
    assert _render(TEMPLATES["llama"], [{"role": "user", "content": " hi "}]).startswith("<s><|user|>\nhi</s>\n")


def test_raise_exception_and_failing_templates_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="Conversation roles"):
        _render(TEMPLATES["llama"], [{"role": "user", "content": "a"}, {"role": "pirate", "content": "b"}])
    with pytest.raises(TemplateError):
        _render("{{ messages[0].content.nope() }}", [{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError, match="compile"):
        _render("{% for %}", [{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError, match="empty"):
        _render(DUMP, [])


def test_continue_final_message_leaves_the_last_message_open() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "the answer is"}]
    text = _render(TEMPLATES["tiny"], messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|user|>\nq</s>\n<|assistant|>\nthe answer is"
    with pytest.raises(TemplateError, match="Cannot set both"):
        _render(TEMPLATES["tiny"], messages, continue_final_message=True)


def test_named_templates_tool_use_and_the_servers_template() -> None:
    chat = ChatTemplate({"default": "D", "tool_use": "T"}, {})
    assert render_chat(chat, [{"role": "user", "content": "x"}]) == "D"
    assert render_chat(chat, [{"role": "user", "content": "x"}],
                       ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}])) == "T"  # fmt: skip
    assert render_chat(chat, [{"role": "user", "content": "x"}], ChatOptions(chat_template="tool_use")) == "T"
    assert render_chat(chat, [{"role": "user", "content": "x"}], ChatOptions(chat_template="R{{ 1 }}")) == "R1"
    server = ChatTemplate({"default": "D"}, {}, server_template="S")
    assert render_chat(server, [{"role": "user", "content": "x"}]) == "S"
    with pytest.raises(Unsupported):
        render_chat(ChatTemplate({}, {}), [{"role": "user", "content": "x"}])


def test_multimodal_content_and_odd_messages_are_unsupported() -> None:
    for messages in (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 3}],
        [{"content": "no role"}],
    ):
        with pytest.raises(Unsupported):
            _render(DUMP, messages)


def test_the_claude_code_billing_header_line_is_dropped_from_system_parts() -> None:
    messages = [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nrules"},
                                               {"type": "text", "text": "x-anthropic-billing-header: only"}]}]  # fmt: skip
    assert _dumped(_render(DUMP, messages))[0]["content"] == "rules"


def test_generation_blocks_render_their_body() -> None:
    assert _render("{% generation %}G{% endgeneration %}", [{"role": "user", "content": "x"}]) == "G"
