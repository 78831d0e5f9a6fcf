"""The runtime's public API: load an artifact folder once, then stream chat turns."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvedge.contract import ONNX_FILE, Manifest, sha256_files
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.runtime.backend import OrtBackend
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import Event, SamplingConfig, generate
from kvedge.runtime.tokenizer import ChatTokenizer, TextStream

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Model:
    """An exported model with its tokenizer and a preallocated cache of `slots` sequences."""

    def __init__(
        self,
        folder: str | Path,
        slots: int = 1,
        threads: int | None = None,
        provider: str = "cpu",
        verify: bool = True,
    ) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KvedgeError(f"model folder {str(self.folder)!r} does not exist")
        self.manifest = Manifest.load(self.folder)
        if verify:
            onnx_files = [self.folder / ONNX_FILE]
            data = self.folder / (ONNX_FILE + ".data")
            if data.exists():
                onnx_files.append(data)
            found = sha256_files(onnx_files)
            if found != self.manifest.onnx_fingerprint:
                raise ArtifactMismatch(
                    f"{self.folder / ONNX_FILE}: graph fingerprint {found[:16]} does not match the "
                    f"manifest's {self.manifest.onnx_fingerprint[:16]}; re-export the model"
                )
        self.backend = OrtBackend(self.folder, self.manifest, threads=threads, provider=provider)
        self.tokenizer = ChatTokenizer(self.folder, self.manifest)
        self.cache = KVCache(self.manifest.geometry, slots)
        log.info(
            "loaded %s: %d slots x %d tokens, KV pool %.1f MiB",
            self.folder,
            slots,
            self.manifest.geometry.max_len,
            self.cache.nbytes / 2**20,
        )

    def stream(
        self, prompt: str, config: SamplingConfig, raw: bool = False, slot: int = 0
    ) -> Iterator[Event]:
        """One stateless turn: `prompt` as a user message (or raw text), from an empty slot."""
        ids = (
            self.tokenizer.encode(prompt)
            if raw
            else self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        )
        self.cache.reset(slot)
        yield from generate(
            self.backend,
            self.cache,
            slot,
            ids,
            config,
            self.manifest.eos_token_ids,
            TextStream(self.tokenizer, config.stop),
        )

    def chat(
        self, messages: Sequence[dict[str, str]], config: SamplingConfig, slot: int = 0
    ) -> Iterator[Event]:
        """Answer the conversation `messages`, reusing whatever prefix `slot` already holds.

        The slot rewinds to the longest common token prefix of what it holds and the rendered
        conversation, then prefills only the rest, so edited or resent history stays exact.
        """
        ids = self.tokenizer.encode_chat(messages)
        held = self.cache.token_ids(slot)
        keep = common_prefix(held, ids)
        if keep == len(ids):
            keep -= 1  # the last prompt token must be run to get next-token logits
        self.cache.truncate(slot, keep)
        log.debug("slot %d: reusing %d cached tokens, prefilling %d", slot, keep, len(ids) - keep)
        yield from generate(
            self.backend,
            self.cache,
            slot,
            ids[keep:],
            config,
            self.manifest.eos_token_ids,
            TextStream(self.tokenizer, config.stop),
        )
