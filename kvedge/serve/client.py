"""A streaming client for a running `kvedge serve` (what `kvedge chat --url` talks through).

The bearer key, when the server wants one, is read from $KVEDGE_API_KEY.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from kvedge.errors import KvedgeError
from kvedge.runtime.generate import Event, SamplingConfig

API_KEY_ENV = "KVEDGE_API_KEY"


class RemoteChat:
    def __init__(
        self, url: str, config: SamplingConfig, timeout_s: float = 300.0, speculate: str | None = None
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.config = config
        self.speculate = speculate  # sent where given (chat --speculate); else the service's default
        key = os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def request(self, messages: Sequence[dict[str, str]]) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {
            "messages": list(messages),
            "stream": True,
            "max_tokens": c.max_new_tokens,
            "temperature": c.temperature,
            "top_p": c.top_p,
        }
        extras = {
            "seed": c.seed,
            "stop": list(c.stop) or None,
            "top_k": c.top_k or None,
            "speculate": self.speculate,
        }
        if c.repetition_penalty != 1.0:
            extras["repetition_penalty"] = c.repetition_penalty
        return body | {k: v for k, v in extras.items() if v is not None}

    def events(
        self, messages: Sequence[dict[str, str]], stop: Callable[[], bool] = lambda: False
    ) -> Iterator[Event]:
        """The assistant's reply to `messages`: an event per text delta, then one with the finish
        reason and the usage counts. `stop`, asked before each line of the stream: when true the
        stream is closed there, and the server ends the turn as for any client that disconnects
        (its slot keeps what it wrote)."""
        try:
            with self.client.stream("POST", self.url, json=self.request(messages)) as response:
                if response.status_code != 200:
                    response.read()
                    raise KvedgeError(f"server answered {response.status_code}: {_message(response)}")
                for line in response.iter_lines():
                    if stop():
                        return
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        return
                    yield from _chunk_events(json.loads(data))
        except httpx.HTTPError as exc:
            raise KvedgeError(f"cannot talk to {self.url}: {exc}") from None


def _chunk_events(chunk: dict[str, Any]) -> Iterator[Event]:
    if "error" in chunk:
        raise KvedgeError(f"server error: {chunk['error'].get('message')}")
    usage = chunk.get("usage") or {}
    for choice in chunk.get("choices", []):
        text = choice.get("delta", {}).get("content") or ""
        finish = choice.get("finish_reason")
        if text or finish:
            yield Event(
                text=text,
                finish_reason=finish,
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
            )


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
