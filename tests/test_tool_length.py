"""Tool calls cut short by max_tokens (issue 28, rough edge 6): the calls that completed come back
as `tool_calls` with finish_reason "length", never the half-written markup as content; a named
tool_choice ends the reply after its one call unless parallel_tool_calls is true.

Driven by the client that hit it, LangChain's ChatOpenAI (langchain-openai), and the official
`openai` client, against a real server on 127.0.0.1: a tiny random Qwen2 whose replies the tool
grammar makes calls (kvedge's fallback tool prompt), and the real default model (SmolLM2, marked
real_model) as the issue saw it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from test_serve import KEY, Server
from test_structured import streamed_tool_calls
from tiny import make_tiny_model

from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model
from kvedge.serve import tools

SET_LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "description": "Switch the light of a room on or off.",
        "parameters": {
            "type": "object",
            "properties": {
                "room": {"type": "string", "enum": ["kitchen", "hall", "bedroom"]},
                "on": {"type": "boolean"},
            },
            "required": ["room", "on"],
        },
    },
}
ASK = [{"role": "user", "content": "Turn on the kitchen light, then the hall light."}]
CALL = '{"name": "set_light", "arguments": {"room": "kitchen", "on": true}}'


# -- the parser, on the replies each format writes ----------------------------------------


def finish(fmt: tools.ToolFormat, text: str, cut: bool) -> tuple[list[dict], bool]:
    parser = tools.ReplyParser(True, False, fmt)
    deltas = parser.push(text)
    last, calls = parser.finish(cut=cut)
    return deltas + last, calls


@pytest.mark.parametrize(
    "fmt, complete, cut_inside",
    [
        (tools.Hermes("fallback"), f"<tool_call>\n{CALL}\n</tool_call>", '\n<tool_call>\n{"name": "set_l'),
        (
            tools.Mistral(None, space=False),
            f'[TOOL_CALLS][{CALL[:-1]}, "id": "a1B2c3D4e"}}',
            ', {"name": "se',
        ),
    ],
    ids=["hermes", "mistral"],
)
def test_a_cut_reply_gives_the_calls_that_completed_and_no_markup(fmt, complete, cut_inside):
    deltas, calls = finish(fmt, complete + cut_inside, cut=True)
    assert calls and [d for d in deltas if "content" in d] == []
    (delta,) = deltas
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in delta["tool_calls"]] == [
        ("set_light", {"room": "kitchen", "on": True})
    ]
    # cut inside the first call, or inside the opening itself: nothing completed, nothing shown
    for text in (complete[: len(complete) // 2], complete[:3]):
        deltas, calls = finish(fmt, text, cut=True)
        assert not calls and all(not d.get("content") and not d.get("tool_calls") for d in deltas), text


def test_a_cut_llama3_call_gives_no_call_and_no_markup():
    deltas, calls = finish(tools.Llama3Json(), '{"name": "set_light", "parameters": {"room": "ki', cut=True)
    assert not calls and deltas == []


def test_a_named_function_means_one_call_unless_parallel_is_given():
    from kvedge.serve.protocol import parse_chat_request

    named = {"type": "function", "function": {"name": "set_light"}}
    body = {"messages": ASK, "tools": [SET_LIGHT]}
    assert not parse_chat_request({**body, "tool_choice": named}).parallel_tool_calls
    assert parse_chat_request({**body, "tool_choice": named, "parallel_tool_calls": True}).parallel_tool_calls
    assert parse_chat_request({**body, "tool_choice": "required"}).parallel_tool_calls
    assert parse_chat_request({**body, "tool_choice": "auto"}).parallel_tool_calls


# -- a real server, the clients that meet it --------------------------------------------------


def set_light(room: Literal["kitchen", "hall", "bedroom"], on: bool) -> None:
    """Switch the light of a room on or off."""


# A call block is 86 tokens of the tiny tokenizer (about one a character): 130 hold one call and
# cut the next. Sampled with seed 4, the tiny model writes four calls when it may (checked below).
ONE_AND_A_PART = 130
SEED = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_length")
    source = make_tiny_model(root / "hf", "qwen2", seed=3)
    # the tiny tokenizer spends a token on every few characters: tool prompts need room
    export_model(source, root / "out", ExportRecipe(max_len=2048))
    srv = Server(root / "out", root, slots=1, queue_size=4, default_max_tokens=64)
    srv.startup()
    yield srv
    srv.stop()


def langchain(server, max_tokens: int, temperature: float = 1.0, **bind) -> Any:
    """LangChain's ChatOpenAI as the issue used it, bound to `set_light` by name."""
    model = ChatOpenAI(
        base_url=server.url + "/v1",
        api_key=KEY,
        model="tiny",
        max_tokens=max_tokens,  # sent as max_completion_tokens
        temperature=temperature,
        seed=SEED,
        max_retries=0,
    )
    return model.bind_tools([set_light], tool_choice="set_light", **bind)


def test_langchain_named_tool_choice_gets_its_one_call(server):
    # the premise: allowed several calls, this sampling writes more than one
    several = langchain(server, 400, parallel_tool_calls=True).invoke(ASK[0]["content"])
    assert len(several.tool_calls) >= 2, several

    named = langchain(server, ONE_AND_A_PART).invoke(ASK[0]["content"])
    assert named.response_metadata["finish_reason"] == "tool_calls", named
    assert [c["name"] for c in named.tool_calls] == ["set_light"] and named.content == ""
    assert named.tool_calls[0]["args"] == several.tool_calls[0]["args"]  # the same first call


def test_calls_cut_by_max_tokens_come_back_as_the_completed_calls(server):
    whole = langchain(server, 400, parallel_tool_calls=True).invoke(ASK[0]["content"])
    cut = langchain(server, ONE_AND_A_PART, parallel_tool_calls=True).invoke(ASK[0]["content"])
    assert cut.response_metadata["finish_reason"] == "length", cut
    assert "<tool_call>" not in cut.content and not cut.invalid_tool_calls
    assert [c["args"] for c in cut.tool_calls] == [whole.tool_calls[0]["args"]]

    # streamed, the same calls and finish reason reach the official client's deltas
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[convert_to_openai_tool(set_light)],  # as LangChain sends it: the same prompt
        tool_choice={"type": "function", "function": {"name": "set_light"}},
        parallel_tool_calls=True,
        max_completion_tokens=ONE_AND_A_PART,
        temperature=1.0,
        seed=SEED,
        stream=True,
    )
    calls, finish = streamed_tool_calls(stream)
    assert finish == "length"
    assert [json.loads(c["arguments"]) for c in calls] == [whole.tool_calls[0]["args"]]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, default_export):
    root = tmp_path_factory.mktemp("smollm2")
    srv = Server(default_export(ExportRecipe(max_len=2048)), root, slots=1, queue_size=2, warmup_tokens=0)
    srv.startup(timeout_s=300)
    yield srv
    srv.stop()


@pytest.mark.real_model
def test_the_default_model_with_max_tokens_64_as_the_issue_saw_it(smollm2):
    # greedy, allowed several calls, SmolLM2 writes one whole set_light call, then a second
    # that 64 tokens cut: the issue's reply, which LangChain read as no call at all
    cut = langchain(smollm2, 64, temperature=0.0, parallel_tool_calls=True).invoke(ASK[0]["content"])
    assert cut.response_metadata["finish_reason"] == "length" and cut.usage_metadata["output_tokens"] == 64
    assert cut.content == "" and not cut.invalid_tool_calls
    assert [c["name"] for c in cut.tool_calls] == ["set_light"]

    named = langchain(smollm2, 64, temperature=0.0).invoke(ASK[0]["content"])
    assert named.response_metadata["finish_reason"] == "tool_calls" and named.content == ""
    assert [c["args"] for c in named.tool_calls] == [cut.tool_calls[0]["args"]]
