"""Structured output, tool calls, logprobs and /v1/completions through a real server on
127.0.0.1, driven by the official `openai` client; outputs checked with a JSON Schema validator.
The model is a tiny random Qwen2 with a ChatML template that knows nothing of tools, so tools
take kvedge's fallback prompt (kvedge/serve/tools.py); a template that renders tools natively is
checked at the rendering level."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_serve import KEY, Server
from tiny import make_tiny_model

from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model
from kvedge.runtime.model import Model, SamplingConfig
from kvedge.serve import tools
from kvedge.serve.app import merge_deltas

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    source = make_tiny_model(root / "hf", "qwen2", seed=3)
    # the tiny tokenizer spends a token on every few characters: tool prompts need room
    export_model(source, root / "out", ExportRecipe(max_len=2048))
    return root / "out"


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    srv = Server(artifact, tmp_path_factory.mktemp("server"), slots=2, queue_size=8, default_max_tokens=64)
    srv.startup()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_responses_parse_and_validate(client):
    for seed in range(10):
        done = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            seed=seed,
            temperature=1.0,
            max_tokens=120,
            response_format=schema_format(PERSON),
        )
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)


def test_json_object_responses_are_objects(client):
    for seed in range(3):
        done = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            seed=seed,
            temperature=0.7,
            max_tokens=200,
            response_format={"type": "json_object"},
        )
        if done.choices[0].finish_reason == "stop":  # a random model may write a long object
            assert isinstance(json.loads(done.choices[0].message.content), dict)


def required_call(seed: int, max_tokens: int, parallel: bool = False) -> dict:
    """Fields of a request that must call WEATHER or TIME about ASK (sampled with `seed`)."""
    return dict(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=parallel,
        seed=seed,
        temperature=1.0,
        max_tokens=max_tokens,
    )


def arguments_valid(call) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_round_trip_reuses_the_cached_prefix(client, server):
    first = client.chat.completions.create(**required_call(1, 100))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        arguments_valid(call)
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
        model="tiny",
        messages=history,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=8,
        temperature=0.0,
    )
    assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
    after = server.wait_idle()
    reused = after["kvedge_prefix_cache_hit_tokens_total"] - before["kvedge_prefix_cache_hit_tokens_total"]
    # the whole first exchange (prompt, and the call block written exactly as generated) is reused
    assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 2, (reused, first.usage)


def test_named_and_auto_tool_choice(client):
    named = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        seed=2,
        temperature=1.0,
        max_tokens=100,
    )
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for call in calls:
        arguments_valid(call)
    for seed in range(4):  # auto: text, or calls whose arguments are valid
        auto = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], seed=seed, temperature=1.0, max_tokens=60
        )
        message = auto.choices[0].message
        if message.tool_calls:
            assert auto.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                arguments_valid(call)
        else:
            assert not message.content.lstrip().startswith("<")


def streamed_tool_calls(stream) -> tuple[list[dict], str | None]:
    """The tool calls a stream's deltas add up to ({"id", "name", "arguments"}, by index) and
    its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_reassemble_to_the_non_streamed_result(client):
    fields = required_call(5, 100)
    whole = client.chat.completions.create(**fields).choices[0]
    calls, finish = streamed_tool_calls(client.chat.completions.create(**fields, stream=True))
    assert finish == whole.finish_reason == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]


def test_logprobs(client, artifact):
    done = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3
    )
    entries = done.choices[0].logprobs.content
    assert len(entries) == done.usage.completion_tokens - (done.choices[0].finish_reason == "stop")
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
    events = list(Model(artifact).chat(ASK, SamplingConfig(max_new_tokens=6, logprobs=3)))
    assert [round(e.logprob, 4) for e in events if e.logprob is not None] == [
        round(e.logprob, 4) for e in entries
    ]


def test_text_completions_equal_a_raw_prompt(client, artifact):
    prompt = "The quick brown fox"
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, logprobs=2)
    events = list(Model(artifact).stream(prompt, SamplingConfig(max_new_tokens=12), raw=True))
    assert done.choices[0].text == "".join(e.text for e in events)
    assert len(done.choices[0].logprobs.tokens) == len(
        [e for e in events if e.logprob is None and e.token is not None]
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, stream=True
        )
        if c.choices
    )
    assert streamed == done.choices[0].text


BAD = [
    ({"response_format": schema_format({"type": "object", "properties": 5})}, "response_format"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools.[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template_kwargs": {"bogus": True}}, "chat_template_kwargs"),
]


def test_bad_structured_requests_are_400_and_the_server_keeps_serving(server):
    for fields, param in BAD:
        response = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, **fields})
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, (fields, response.json())
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
    }
    response = server.http.post("/v1/chat/completions", json={"messages": [*ASK, call]})
    assert response.status_code == 400 and "arguments" in response.json()["error"]["param"]
    assert (
        server.http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200
    )


LINK = {
    "type": "object",
    "properties": {"href": {"type": "string", "format": "url", "maxLength": 10}},
    "required": ["href"],
    "additionalProperties": False,
}
OVERLAPPING = {
    "type": "object",
    "properties": {"n": {"oneOf": [{"type": "number", "maximum": 9}, {"type": "integer", "maximum": 9}]}},
    "required": ["n"],
    "additionalProperties": False,
}


def schema_reply(server, schema: dict, stream: bool = False):
    body = {"messages": ASK, "seed": 1, "temperature": 1.0, "max_tokens": 60, "stream": stream}
    return server.http.post("/v1/chat/completions", json={**body, "response_format": schema_format(schema)})


def test_unknown_formats_are_ignored_and_said_so_in_a_header(server):
    """The spec reads an unknown format as an annotation: the schema compiles, the reply validates,
    and the header names what was not enforced (kvedge.runtime.json_schema)."""
    for stream in (False, True):
        response = schema_reply(server, LINK, stream)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvedge-schema-ignored"] == "format=url"
    jsonschema.validate(
        json.loads(schema_reply(server, LINK).json()["choices"][0]["message"]["content"]), LINK
    )
    assert "x-kvedge-schema-ignored" not in schema_reply(server, PERSON).headers
    refused = schema_reply(server, OVERLAPPING)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    assert "oneOf at /properties/n" in refused.json()["error"]["message"]
    assert "lenient_schemas" in refused.json()["error"]["message"]


def test_lenient_schemas_read_an_overlapping_one_of_as_any_of(artifact, tmp_path):
    with Server(artifact, tmp_path, lenient_schemas=True, default_max_tokens=64) as server:
        response = schema_reply(server, OVERLAPPING)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvedge-schema-ignored"] == "oneOf=anyOf"
        any_of = json.loads(json.dumps(OVERLAPPING).replace("oneOf", "anyOf"))
        jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), any_of)
        assert "not enforced: oneOf=anyOf" in server.output()


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_natively(artifact, tmp_path):
    """Tools and tool calls reach a Qwen-style template as transformers passes them; tojson is
    plain JSON (not HTML-escaped); enable_thinking reaches the template."""
    folder = tmp_path / "native"
    folder.mkdir()
    for item in artifact.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / "chat_template.jinja").write_text(QWEN_LIKE)
    model = Model(folder)
    assert tools.tool_format(model.tokenizer.template_source) == "native"
    parsed = tools.parse_tools([WEATHER])
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "<sun>"},
    ]
    text = model.tokenizer.render(
        tools.prompt_messages(history, parsed, "native"), tools=[t.openai() for t in parsed]
    )
    assert '"name": "get_weather", "description": "The weather in a city."' in text
    assert tools.call_block("get_weather", {"city": "Paris", "days": 2}) in text  # as the grammar writes it
    assert "<sun>" in text and "\\u003c" not in text
    off = model.tokenizer.render(ASK, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not model.tokenizer.render(ASK).endswith(
        "</think>\n\n"
    )


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_reply_parser_stream_equals_whole(cut):
    """Any way of cutting a reply into stream pieces gives the same message as the whole."""
    block = tools.call_block("get_weather", {"city": "Paris", "days": 2})
    for reply, thinking, use_tools in [
        ("<think>\nplan it\n</think>\n\nThe answer.", True, False),
        ("  " + block + "\n" + block, False, True),
        ("<think>x</think>\n\n" + block, True, True),
        ("Plain text with <tool_call> later.", False, True),
        ("<thin", True, False),
    ]:
        whole = tools.ReplyParser(use_tools, thinking)
        deltas = whole.push(reply)
        last, calls = whole.finish()
        want = merge_deltas(deltas + last)
        parser = tools.ReplyParser(use_tools, thinking)
        pieces = [d for i in range(0, len(reply), cut) for d in parser.push(reply[i : i + cut])]
        rest, calls_streamed = parser.finish()
        got = merge_deltas(pieces + rest)
        for message in (want, got):
            for c in message.get("tool_calls", []):
                c["id"] = "x"
        assert got == want and calls == calls_streamed, (reply, got, want)
        if reply.startswith("<think>\nplan"):
            assert want == {"content": "The answer.", "reasoning_content": "\nplan it\n"}
        if use_tools and reply.lstrip().startswith("<tool_call>"):
            assert calls and [c["function"]["name"] for c in want["tool_calls"]] == [
                "get_weather"
            ] * reply.count("<tool_call>")
