"""Native tool calls for Llama 3.1+ (JSON calls) and Mistral ([TOOL_CALLS] lists), through a real
server on 127.0.0.1 driven by the official `openai` client.

The real templates are not available here (no model hub), so the templates below are small copies
of the real ones' tool parts, written to render the same text:

    LLAMA31          meta-llama/Llama-3.1-8B-Instruct's chat_template (as in llama.cpp's
                     models/templates and vLLM's examples/tool_chat_template_llama3.1_json.jinja):
                     tools as JSON in the first user message, a call written as
                     {"name": "...", "parameters": <tojson>} ending in <|eot_id|> (<|eom_id|> with
                     built-in tools, which go through <|python_tag|>), one call per message (it
                     raises on more), tool results as `ipython` messages
    MISTRAL_NEMO     mistralai/Mistral-Nemo-Instruct-2407 (llama.cpp's
                     models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja): [AVAILABLE_TOOLS]
                     before the last user message, "[TOOL_CALLS][" + each call's tojson'd function
                     with `, "id": "<id>"}` + "]" + eos, ids of length 9 or it raises,
                     [TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS], alternating roles
    MISTRAL_SMALL31  mistralai/Mistral-Small-3.1-24B-Instruct-2503 (llama.cpp's
                     models/templates/mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja): the v7
                     spelling, "[TOOL_CALLS] [" and "[TOOL_RESULTS] {", ids of at least 9, last 9 used

The tokenizer carries each family's control tokens as special tokens, as the real ones do, so
`[TOOL_CALLS]` is one token the grammar makes the model write and the decoded text leaves out.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
from test_serve import KEY, Server
from test_structured import ASK, TIME, WEATHER, arguments_valid, required_call, streamed_tool_calls
from tiny import make_tiny_model
from tokenizers import Tokenizer

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.model import Model
from kvedge.serve import protocol, tools
from kvedge.serve.app import merge_deltas

LLAMA31 = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no "
                            + "first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name '
        + 'and its value}. ' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}{%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else %}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}{{- "<|eom_id|>" }}{%- else %}{{- "<|eot_id|>" }}{%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
LLAMA_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

MISTRAL_NEMO = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool"
                or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must "
                                + "alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS]{"content": ' + message.content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported!") }}
    {%- endif %}
{%- endfor %}
"""
# v7: a space after [TOOL_CALLS] and [TOOL_RESULTS]; ids of at least 9 characters, the last 9 written
MISTRAL_SMALL31 = (
    MISTRAL_NEMO.replace('"[TOOL_CALLS]["', '"[TOOL_CALLS] ["')
    .replace("'[TOOL_RESULTS]{", "'[TOOL_RESULTS] {")
    .replace("tool_call.id|length != 9", "tool_call.id|length < 9")
    .replace("message.tool_call_id|length != 9", "message.tool_call_id|length < 9")
    .replace("+ tool_call.id +", "+ tool_call.id[-9:] +")
    .replace("+ message.tool_call_id +", "+ message.tool_call_id[-9:] +")
)
MISTRAL_TOKENS = [
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
FAMILIES = {
    "llama3": (LLAMA31, LLAMA_TOKENS),
    "mistral_nemo": (MISTRAL_NEMO, MISTRAL_TOKENS),
    "mistral_small31": (MISTRAL_SMALL31, MISTRAL_TOKENS),
}
ID = re.compile(r"^[A-Za-z0-9]{9}$")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_formats")
    source = make_tiny_model(root / "hf", "llama", seed=3)
    # the tiny tokenizer spends a token on every few characters: tool prompts need room
    export_model(source, root / "out", ExportRecipe(max_len=2048))
    return root / "out"


def family_artifact(artifact, folder, family: str):
    """The tiny model with `family`'s template, its control tokens special tokens of the tokenizer."""
    template, specials = FAMILIES[family]
    shutil.copytree(artifact, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, artifact, tmp_path_factory):
    folder = family_artifact(artifact, tmp_path_factory.mktemp(request.param) / "model", request.param)
    srv = Server(folder, tmp_path_factory.mktemp("server"), slots=2, queue_size=8, default_max_tokens=64)
    srv.startup()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield request.param, srv, client, Model(folder)
    srv.stop()


def test_formats_are_told_from_the_template(artifact, tmp_path):
    assert tools.tool_format(LLAMA31) == "llama3_json"
    assert tools.tool_format(MISTRAL_NEMO) == tools.tool_format(MISTRAL_SMALL31) == "mistral"
    assert tools.tool_format("{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}") == "refused"
    assert tools.format_for("{% for t in tools %}<function>{% endfor %}", lambda text: []) is None
    model = Model(family_artifact(artifact, tmp_path / "m", "mistral_small31"))
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fmt = tools.format_for(model.tokenizer.template_source, encode)
    assert isinstance(fmt, tools.Mistral) and fmt.space
    assert fmt.token == model.tokenizer.tokenizer.token_to_id("[TOOL_CALLS]")
    written = tools.format_for(MISTRAL_NEMO, lambda text: [5] * len(text))  # no such token
    assert written.token is None and not written.space
    assert '"[TOOL_CALLS]" "["' in written.constraint(tools.parse_tools([WEATHER]), "required", True).source


def valid_calls(family: str, message) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        arguments_valid(call)
    if family == "llama3":
        assert len(message.tool_calls) == 1  # the templates take one call per message
    else:
        ids = [c.id for c in message.tool_calls]
        assert all(ID.match(i) for i in ids) and len(set(ids)) == len(ids), ids


def test_required_calls_parse_and_validate_for_every_seed(family):
    name, _, client, _ = family
    for seed in range(6):
        # a random model keeps adding Mistral calls: one call a reply there
        done = client.chat.completions.create(**required_call(seed, 120, parallel=name == "llama3"))
        assert done.choices[0].finish_reason == "tool_calls", done
        valid_calls(name, done.choices[0].message)


def test_named_none_and_auto_tool_choice(family):
    name, _, client, _ = family
    named = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        seed=2,
        temperature=1.0,
        max_tokens=120,
    )
    valid_calls(name, named.choices[0].message)
    assert all(c.function.name == "get_time" for c in named.choices[0].message.tool_calls)
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", seed=1, max_tokens=8
    )
    assert none.choices[0].finish_reason in ("stop", "length") and not none.choices[0].message.tool_calls
    opening = "{" if name == "llama3" else "["
    for seed in range(4):  # auto: text not opening like calls, or calls whose arguments are valid
        auto = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            parallel_tool_calls=False,
            seed=seed,
            temperature=1.0,
            max_tokens=120,
        )
        message = auto.choices[0].message
        if message.tool_calls:
            assert auto.choices[0].finish_reason == "tool_calls"
            valid_calls(name, message)
        else:
            assert not message.content.lstrip().startswith(opening)


def test_streamed_calls_reassemble_to_the_non_streamed_result(family):
    name, _, client, _ = family
    fields = required_call(5, 120)
    whole = client.chat.completions.create(**fields).choices[0]
    got, finish = streamed_tool_calls(client.chat.completions.create(**fields, stream=True))
    assert finish == whole.finish_reason == "tool_calls"
    want = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    if name == "llama3":  # ids are drawn per reply; Mistral's are the model's own
        for entry in want + got:
            entry.pop("id")
    assert got == want


def test_round_trip_renders_through_the_template_and_reuses_the_prefix(family):
    _, server, client, _ = family
    first = client.chat.completions.create(**required_call(1, 120))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    before = server.wait_idle()
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": c.id, "content": '{"sky": "clear"}'}
            for c in choice.message.tool_calls
        ],
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
    after = server.wait_idle()
    reused = after["kvedge_prefix_cache_hit_tokens_total"] - before["kvedge_prefix_cache_hit_tokens_total"]
    # the whole first exchange (prompt, and the calls rendered as the model wrote them) is reused
    assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 2, (reused, first.usage)


def call(call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris", "days": 2}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_client_histories_render_the_template_way(family):
    """Ids from other servers (Mistral: mapped to 9 characters, deterministically) and several
    calls in one message (Llama: one assistant message per call) render; the template refusing a
    conversation is a 400 naming its reason."""
    name, server, _, model = family
    ids = ["call_8f3ea1b2c4d5e6f7a8b9c0d1", "call_x"]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call(ids[0]), call(ids[1], "get_time", '{"zone": "UTC"}')],
        },
        {"role": "tool", "tool_call_id": ids[0], "content": "sunny"},
        {"role": "tool", "tool_call_id": ids[1], "content": "noon"},
    ]
    body = {"model": "tiny", "messages": history, "tools": [WEATHER, TIME], "max_tokens": 2}
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    parsed = tools.parse_tools([WEATHER, TIME])
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fmt = tools.format_for(model.tokenizer.template_source, encode)
    messages, template_tools = fmt.prompt(list(protocol.parse_messages(history)), parsed)
    text = model.tokenizer.render(messages, tools=template_tools)
    if name == "llama3":
        assert (
            text.count('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}<|eot_id|>') == 1
        )
        assert text.count("<|start_header_id|>assistant<|end_header_id|>") == 3  # two calls, the reply
        refused = {**body, "messages": [{"role": "system", "content": "Be brief."}]}
        reason = "no first user message"
    else:
        mapped = [tools.mistral_id(i) for i in ids]
        assert all(ID.match(i) for i in mapped)
        assert f'"id": "{mapped[0]}"}}, {{"name": "get_time"' in text and f'"call_id": "{mapped[1]}"' in text
        refused = {**body, "messages": [*ASK, *ASK]}
        reason = "alternate"
    response = server.http.post("/v1/chat/completions", json=refused)
    assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "messages"


def test_mistral_ids():
    assert tools.mistral_id("a1B2c3D4e") == "a1B2c3D4e"  # what the templates take is kept
    mapped = tools.mistral_id("call_8f3ea1b2c4d5e6f7a8b9c0d1")
    assert ID.match(mapped) and mapped == tools.mistral_id("call_8f3ea1b2c4d5e6f7a8b9c0d1")
    assert len({tools.mistral_id(f"call_{i}") for i in range(1000)}) == 1000


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_reply_parser_stream_equals_whole(cut):
    """Any way of cutting a reply into stream pieces gives the same message as the whole."""
    llama, mistral = tools.Llama3Json(), tools.Mistral(token=300, space=True)
    llama_call = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    mistral_calls = (
        ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "a1B2c3D4e"}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "a1B2c3D4e"}]'
    )
    for reply, fmt, n in [
        (llama_call, llama, 1),
        ("Plain text, {not a call}.", llama, 0),
        (mistral_calls, mistral, 2),
        ("[TOOL_CALLS]" + mistral_calls, mistral, 2),  # written as text by a tokenizer without the token
        ("No [calls] here.", mistral, 0),
    ]:
        whole = tools.ReplyParser(True, False, fmt)
        deltas = whole.push(reply)
        last, calls = whole.finish()
        want = merge_deltas(deltas + last)
        parser = tools.ReplyParser(True, False, fmt)
        pieces = [d for i in range(0, len(reply), cut) for d in parser.push(reply[i : i + cut])]
        rest, calls_streamed = parser.finish()
        got = merge_deltas(pieces + rest)
        if fmt is llama:
            for message in (want, got):
                for c in message.get("tool_calls", []):
                    c["id"] = "x"
        assert got == want and calls == calls_streamed == (n > 0), (reply, got, want)
        assert len(want.get("tool_calls", [])) == n
        if fmt is mistral and n:  # a repeated id is replaced, so the calls stay apart
            ids = [c["id"] for c in want["tool_calls"]]
            assert ids[0] == "a1B2c3D4e" and ID.match(ids[1]) and ids[1] != ids[0]
            jsonschema.validate(
                json.loads(want["tool_calls"][1]["function"]["arguments"]), TIME["function"]["parameters"]
            )


def test_grammars_take_the_forms_the_templates_render(artifact, tmp_path):
    """The Mistral grammar takes several calls only under parallel_tool_calls, after the
    tokenizer's own [TOOL_CALLS] token; the Llama grammar takes the JSON call."""
    model = Model(family_artifact(artifact, tmp_path / "m", "mistral_small31"))
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fmt = tools.format_for(model.tokenizer.template_source, encode)
    parsed = tools.parse_tools([WEATHER, TIME])
    two = (
        ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "a1B2c3D4e"}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "f5G6h7I8j"}]'
    )

    def takes(constraint, ids) -> bool:
        matcher = model.grammars.matcher(constraint)
        try:
            for token in ids:
                matcher.accept(token)
        except KvedgeError:
            return False
        return matcher.stopped

    assert takes(fmt.constraint(parsed, "required", True), [fmt.token, *encode(two)])
    assert not takes(fmt.constraint(parsed, "required", False), [fmt.token, *encode(two)])
    assert not takes(fmt.constraint(parsed, "required", True), encode(two))  # no [TOOL_CALLS] token
    assert not takes(fmt.constraint(parsed, "get_time", True), [fmt.token, *encode(two)])  # named
    llama = tools.Llama3Json().constraint(parsed, "auto", True)
    assert takes(llama, encode('{"name": "get_time", "parameters": {"zone": "CET"}}'))
    assert not takes(llama, encode('{"name": "get_time", "parameters": {"zone": "PST"}}'))  # not in enum


def test_a_template_with_another_tool_format_is_refused(artifact, tmp_path):
    folder = family_artifact(artifact, tmp_path / "m", "mistral_nemo")
    # v11's spelling: [TOOL_CALLS]name[ARGS]{...}
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
        "{% if tools %}{% for c in tools %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{% endfor %}{% endif %}"
    )
    (tmp_path / "server").mkdir()
    srv = Server(folder, tmp_path / "server", slots=1, queue_size=2, default_max_tokens=4)
    try:
        srv.startup()
        body = {"model": "tiny", "messages": ASK, "max_tokens": 2}
        refused = srv.http.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
        assert "Mistral [TOOL_CALLS] lists" in refused.json()["error"]["message"]
        assert srv.http.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        srv.stop()
