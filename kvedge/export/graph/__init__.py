"""Build the KV-bound decoder graph in ONNX, op by op, from a Hugging Face state dict.

Why build by hand instead of tracing with `torch.onnx.export`: the op list is ours to choose
(only ops TensorRT's ONNX parser accepts, in the portable variant), tied embeddings are stored
once, and the KV binding below is exact rather than whatever a tracer makes of a cache class.

The contract (declared from `kvedge.contract.GraphInterface`, names from `IONames`)::

    inputs  input_ids      [b, s]                     int64
            position_ids   [b, s]                     int64  (portable only: index into the RoPE tables)
            past_lengths   [b]                        int64  (valid positions of each row's cache)
            last_index     [b] ("last"), [b, r] ("rows") int64  (not when logits="all")
            past K/V per layer [b, kv_heads, L, d]    L = max_len, fixed
    outputs logits         [b, 1 | r | s, vocab] ("last" | "rows" | "all")
            present K/V per layer                     portable: [b, kv_heads, s, d], the new tokens
                                                      only, K after RoPE; ort: [b, kv_heads, L, d],
                                                      the past buffer itself, written in place

Two variants share everything but attention:

`portable` (ONNX opset 17; 21 with quantized weights): standard ops only, for TensorRT and any
runtime. Per layer, with g = heads / kv_heads query heads sharing each KV head and
A = max(past_lengths) the longest valid past in the batch::

    past_k, past_v = past[..., :A, :]                               (Slice: the valid part only)
    q4       = rope(q) * d**-0.5 reshaped to [b, kv_heads, g*s, d]   (scale folded into Wq)
    scores   = concat(q4 @ past_k^T, q4 @ new_k^T) + mask            [b, kv_heads, g*s, A+s]
    probs    = softmax(scores)
    out      = probs[..., :A] @ past_v + probs[..., A:] @ new_v

GQA is a reshape of Q, never a repeat of K/V. The mask is computed once per call from
`past_lengths` (position j of row b is visible iff j < past_lengths[b]) plus a causal mask over the
new tokens; stale data beyond a row's valid length is masked with -inf, so the runtime must keep
buffers finite (they are zero-initialised and only ever written with finite K/V). Slicing to A
makes the work follow the valid length, not max_len; the price is a copy of the valid K/V.

`ort` (opset 17 + com.microsoft; 21 with quantized weights): onnxruntime's GroupQueryAttention
with packed QKV, rotary applied inside the op from the same cos/sin tables, and the past buffer
bound as both input and output (`past_present_share_buffer`), so the new K/V are written into
the cache in place and attention reads only the valid positions::

    seqlens_k              = past_lengths + s - 1                    [b] int32
    total_sequence_length  = max(past_lengths) + s                   scalar int32

GroupQueryAttention takes positions from `seqlens_k` (position of new token i = past length + i,
the same rule as the portable graph), so `position_ids` is not a graph input there. It accepts
s > 1 with a non-empty past only for batch 1; the runtime splits such calls by row.

`ort` with a float16 cache (`--kv-dtype float16`, the form onnxruntime's CUDA provider runs: its
GroupQueryAttention kernels take float16/bfloat16 only): the packed QKV is cast to float16 before
the op and its output back to float32, the cache and the RoPE tables are float16, the rest of the
graph is unchanged. The cache holds half the float32 cache's bytes; the only error is fp16
rounding of Q, K, V and the tables. Its seqlens_k and total_sequence_length are made so that the
decode step can be captured as a CUDA graph (`inplace.GroupQueryAttention`)::

    seqlens_k              = past_lengths + rowlength(input_ids) - 1     [b] int32, on the device
    total_sequence_length  = max_len                                     constant int32

`ort` with the INT8 cache (`--kv-dtype int8`): GroupQueryAttention's own 8-bit cache has static
scales only, so attention is kvedge's onnxruntime kernel `kvedge.Int8CacheAttention`
(`kvedge/runtime/csrc/kvedge_ops.cc`, loaded by the runtime): the same inputs as above plus the
K/V scale buffers, in place; it quantizes the new tokens per token exactly as the portable INT8
graph does and reads each KV head's int8 codes once per step for its whole query group.

Weights: float32, or blocked int8/int4 `DequantizeLinear -> MatMul` (see `quantize.py`) for every
projection and the LM head, their block offsets and kept float32 channels in a second small
product whose inputs `ort` graphs make with kvedge's op `kvedge.SideInputs` (not over a float16
cache, the CUDA form: `kvedge.contract.kvedge_ops`); in a float32 portable graph each product's
input is split in two parts onnxruntime's int8 activations hold (`quant_matmul._product`); the
embedding table stays float32 (one row is read per token).
float16 (`--weights float16`): the projections and the embedding table (the tied LM head) are
stored float16, about half the bytes, each widened by one `Cast` to float32, so arithmetic stays
float32 and the only error is fp16 rounding of the weights (relative 2**-11). onnxruntime and
TensorRT fold the Cast when they load the graph; what the memory then holds is theirs to choose.

The float16 graph (`--precision float16`, portable only; `ExportRecipe.half`): what TensorRT's
strongly typed builder computes in float16, written as such. Weights (float16, or int8/int4
blocks dequantized to float16: the float32 graph's codes, their scales, offsets and kept channels'
rows stored float16), the residual stream, the projections, RoPE and
the MLP are float16; float32 islands, each opened and closed by a Cast (`Builder.widen`,
`narrow`), are where float16 would fail: every RMSNorm (x**2 and its mean: activations of a few
hundred square past float16's 65504; normed and weighted in float32, as transformers does),
softmax (scores widened, the -inf mask added and the probabilities narrowed after), and the
logits (the LM head computes in float16, its output widened: the graph's logits are float32 in
both precisions). The cache is float16 (attention over it in float16 but for the softmax) or
int8: then attention runs in float32 exactly as in a float32 graph, its packed QKV widened and
its output narrowed, since a query times int8 codes before scaling can pass 65504. The graph's
inputs and outputs are those of `GraphInterface` for the export's cache dtype.

Families differ before attention only (`DecoderSpec`, `weights.prepare_weights`), so the three attention
implementations above serve them all: Qwen3's per-head Q/K RMSNorm is applied to the packed QKV,
ahead of every variant's RoPE; Phi-3's fused projections are split and its partial rotary becomes
full rotary over a permuted head (`rotary_frequencies`); SmolLM3's layers without RoPE skip the
rotation (portable), run GroupQueryAttention with do_rotary=0, or give the INT8 kernel tables of
angle 0. Gemma 3's (1 + w) norms are folded into the weights, its extra norms and GELU-tanh are
ops around attention; its sliding-window layers are where attention differs: the portable graph
reads them from ring-buffer caches of window + margin positions through a mask derived from the valid
length (`portable.PortableAttention._ring`, docs/design/kv-contract.md "Ring-buffer layers"), the ort graph
keeps them full length with GroupQueryAttention's local_window_size, or over the INT8 cache the
kernel's attribute of the same name and meaning; all with their own RoPE tables.
Gemma 4's sliding layers have their own head_dim: the portable graph reads them from rings as
Gemma 3's, the ort graph from rings of max_len that never wrap (written in place at p, as above,
with local_window_size); its shared-KV layers attend over their source's K/V: in the portable
graph over what the source's attention read, in the ort graph over the source's present buffer
in standard ops (`inplace.SharedReads`), since GroupQueryAttention hands on nothing it read.

The package, one idea per module (each imports only those listed before it):

    options       DecoderSpec, the graph's opset and the checks of what can be built
    external      ExternalData: the data file large initializers are written to as they are made
    builder       Builder: nodes and initializers, float16 islands (widen / narrow)
    rope          RoPE tables, the partial-rotary channel order, the rotation in ops
    quant_matmul  blocked integer weights: DequantizeLinear -> MatMul, side inputs, QuantMatMul
    norms         RMSNorm and the residual add before it
    weights       the state dict in the layout the graph is built from (where families differ)
    int8_codec    the INT8 cache's quantization in ops (portable)
    portable      the portable variant's attention: slices, the mask, the sliding-window rings
    inplace       the ort variant's attentions: GroupQueryAttention, kvedge.Int8CacheAttention
    forms         the ModelProto: one form, or prefill and decode forms under one If; graph walks
    decoder       Decoder and build_decoder_graph, the entry point
"""

from kvedge.export.graph.decoder import build_decoder_graph
from kvedge.export.graph.forms import all_graphs, decode_step_graphs
from kvedge.export.graph.options import (
    GATED_ACTIVATIONS,
    HALF_KV_DTYPES,
    MS_DOMAIN,
    OPSET,
    QUANTIZED_OPSET,
    STATIC_ROPE_TYPES,
    DecoderSpec,
    DeltaNetSpec,
    Gemma4Spec,
    check_gemma4,
    check_ring,
    check_states,
    conv_layers,
    graph_opset,
    local_layers,
)
from kvedge.export.graph.rope import rope_tables, rotary_frequencies

__all__ = [
    "GATED_ACTIVATIONS",
    "HALF_KV_DTYPES",
    "MS_DOMAIN",
    "OPSET",
    "QUANTIZED_OPSET",
    "STATIC_ROPE_TYPES",
    "DecoderSpec",
    "DeltaNetSpec",
    "Gemma4Spec",
    "all_graphs",
    "build_decoder_graph",
    "check_gemma4",
    "check_ring",
    "check_states",
    "conv_layers",
    "decode_step_graphs",
    "graph_opset",
    "local_layers",
    "rope_tables",
    "rotary_frequencies",
]
