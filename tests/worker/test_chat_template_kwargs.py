"""Issue 30: a chat template's extra variables (vLLM's `chat_template_kwargs`) render as transformers
renders them, e.g. Qwen3's `enable_thinking` switch, and the renderer's own names cannot be replaced.

transformers is the oracle: its `apply_chat_template(..., **kwargs)` makes every extra keyword a
template variable. Both render the same template over the same tokenizer (a byte-level BPE built
here, offline). The gateway side (the request field, its 400s, the prompt it renders) is in
tests/control_plane/test_openai_answers.py.
"""

from __future__ import annotations

import pytest

from inferplane.api.tokenizer import RESERVED_TEMPLATE_VARIABLES, TextTokenizer
from tests.control_plane.test_gateway_loop import byte_tokenizer

# Qwen3's chat template (Qwen/Qwen3-8B), less its tool branches: the reasoning of earlier turns is
# dropped, and `enable_thinking=False` opens the answer with an empty <think> block.
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _tokenizers() -> tuple[TextTokenizer, object]:
    """Ours and transformers' over one byte-level BPE with <s> and </s> (no network, no files)."""
    from dataclasses import replace

    transformers = pytest.importorskip("transformers")
    ours = replace(byte_tokenizer(), chat_template=QWEN3_TEMPLATE)
    tok = ours.tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = QWEN3_TEMPLATE
    return ours, hf


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["no-switch", "thinking-off", "thinking-on"])
def test_the_thinking_switch_renders_as_transformers_renders_it(kwargs: dict) -> None:
    ours, hf = _tokenizers()
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    rendered = ours.apply_chat_template(CHAT, add_generation_prompt=True, template_kwargs=kwargs or None)
    assert rendered == expected
    # The switch really is what differs: off opens the answer with an empty think block, on (or unset) does not.
    assert rendered.endswith(EMPTY_THINK) == (kwargs.get("enable_thinking") is False)
    assert "Add them." not in rendered  # an earlier turn's reasoning is dropped, as Qwen3's template does


def test_variables_the_template_does_not_read_change_nothing() -> None:
    ours, hf = _tokenizers()
    kwargs = {"reasoning_effort": "low", "custom": {"a": [1, 2]}}
    assert ours.apply_chat_template(CHAT, template_kwargs=kwargs) == \
        ours.apply_chat_template(CHAT) == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", [*sorted(RESERVED_TEMPLATE_VARIABLES), "raise_exception", "namespace", "range"])
def test_a_name_the_renderer_sets_is_refused_naming_it(name: str) -> None:
    ours, _ = _tokenizers()
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name}: .*cannot be overridden"):
        ours.apply_chat_template(CHAT, template_kwargs={"enable_thinking": False, name: "x"})


def test_kwargs_that_are_not_an_object_of_named_variables_are_refused() -> None:
    ours, _ = _tokenizers()
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: must be an object"):
        ours.apply_chat_template(CHAT, template_kwargs=["enable_thinking"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: variable names must be strings"):
        ours.apply_chat_template(CHAT, template_kwargs={1: True})  # type: ignore[dict-item]


def test_a_value_the_template_cannot_use_is_a_value_error_not_a_crash() -> None:
    """A request's variable of the wrong type fails the render: the request's 400, not a 500."""
    ours = TextTokenizer(tokenizer=_tokenizers()[0].tokenizer, chat_template="{{ budget + 1 }}")
    assert ours.apply_chat_template(CHAT, template_kwargs={"budget": 1}) == "2"
    with pytest.raises(ValueError, match="^chat template: could not render"):
        ours.apply_chat_template(CHAT, template_kwargs={"budget": "many"})


def test_llm_chat_passes_its_kwargs_to_the_template() -> None:
    """`LLM.chat(..., chat_template_kwargs=...)`, as vLLM's offline API takes it (no model loaded:
    what reaches `generate` is the rendered prompt)."""
    from inferplane.worker.llm import LLM

    ours, hf = _tokenizers()
    llm = LLM.__new__(LLM)
    llm.tokenizer = ours
    llm.generate = lambda prompts, params=None, cache_salt="": prompts  # type: ignore[method-assign]
    off = {"enable_thinking": False}
    assert llm.chat(CHAT, chat_template_kwargs=off) == [
        hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **off)]
    assert llm.chat([CHAT, CHAT]) == [hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)] * 2
    with pytest.raises(ValueError, match=r"chat_template_kwargs\.messages"):
        llm.chat(CHAT, chat_template_kwargs={"messages": []})


def test_tojson_and_loop_controls_render_as_transformers_renders_them() -> None:
    """Tool lists printed with `tojson` keep key order and non-ASCII text, and `{% break %}` works,
    as in transformers' renderer (Jinja's own tojson sorts keys and escapes `<`)."""
    ours, hf = _tokenizers()
    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }};{% endfor %}"
                "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}")
    tools = [{"type": "function", "function": {"name": "météo", "description": "<city> weather", "b": 1, "a": 2}}]
    ours.chat_template = hf.chat_template = template
    expected = hf.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=False, tools=tools) == expected
    assert '"météo"' in expected and '"b": 1, "a": 2' in expected
