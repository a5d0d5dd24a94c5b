"""The ONNX side of the TreeFlash custom op: the node the exporter emits, the body
ONNX Runtime runs it with, and the split TensorRT's plugins need.

``treeflash.MlpExpand`` (domain ``treeflash``, version 1)
    inputs   z [B, H], parent_ids [B-1, M] int64, embed_weight [V, H], head_norm_weight [H],
             ug_weight [2I, 2H], ug_bias [2I], d_weight [H, I], norm_weight [H]
    output   out [B-1, M, H] (z's dtype)
    attrs    head_eps, norm_eps (float); plugin_namespace, plugin_version (string), which
             TensorRT's ONNX parser reads to find a plugin for an unknown op_type

The exported ``plugin`` graphs carry the node only. ONNX Runtime gets a model-local
function body attached in memory (``with_function_bodies``); the files themselves
stay free of it so that TensorRT's parser reaches its plugin registry. Nothing here
imports TensorRT.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "treeflash"
OP_TYPE = "MlpExpand"
VERSION = 1
PLUGIN_NAMESPACE = "treeflash"
PLUGIN_VERSION = "1"
INPUTS = ("z", "parent_ids", "embed_weight", "head_norm_weight", "ug_weight", "ug_bias", "d_weight", "norm_weight")
FLOAT_ATTRS = ("head_eps", "norm_eps")


def register_schema() -> None:
    """Register MlpExpand's schema with onnx (the exporter and the checker look it up); idempotent."""
    from onnx import defs

    if defs.has(OP_TYPE, DOMAIN):
        return
    P = defs.OpSchema.FormalParameter
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    schema = defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        doc="TreeFlash MLP expansion: head + final norm for every (block position, parent) pair.",
        inputs=[P(name, "I" if name == "parent_ids" else "T") for name in INPUTS],
        outputs=[P("out", "T")],
        type_constraints=[("T", floats, "float tensors"), ("I", ["tensor(int64)"], "token ids")],
        attributes=[*(defs.OpSchema.Attribute(a, defs.OpSchema.AttrType.FLOAT, "RMSNorm epsilon")
                      for a in FLOAT_ATTRS),
                    *(defs.OpSchema.Attribute(a, defs.OpSchema.AttrType.STRING, "TensorRT plugin lookup")
                      for a in ("plugin_namespace", "plugin_version"))],
    )
    defs.register_schema(schema)


def translation_table() -> dict:
    """custom_translation_table for torch.onnx.export(dynamo=True): the custom op -> one node."""
    import onnxscript
    import torch

    register_schema()
    import treeflash_kernels.ops  # noqa: F401  (registers torch.ops.treeflash.mlp_expand)

    opset = onnxscript.values.Opset(domain=DOMAIN, version=VERSION)

    def mlp_expand(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight,
                   head_eps: float, norm_eps: float):
        return opset.MlpExpand(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight,
                               norm_weight, head_eps=float(head_eps), norm_eps=float(norm_eps),
                               plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)

    return {torch.ops.treeflash.mlp_expand.default: mlp_expand}


def _const_ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                             [len(values)], values))


def _rms_norm(x: str, w: str, eps_attr: str, p: str) -> list[onnx.NodeProto]:
    """Qwen3's RMSNorm in standard ops: float32 statistics, cast back, then scale."""
    eps = helper.make_node("Constant", [], [f"{p}_eps"])
    # the value is the calling node's attribute `eps_attr` (built by hand: onnx before 1.22 has no
    # ref_attr_name argument in helper.make_attribute_ref)
    eps.attribute.append(onnx.AttributeProto(name="value_float", type=onnx.AttributeProto.FLOAT,
                                             ref_attr_name=eps_attr))
    return [
        helper.make_node("Cast", [x], [f"{p}_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{p}_f", f"{p}_f"], [f"{p}_sq"]),
        helper.make_node("ReduceMean", [f"{p}_sq", "axis_last"], [f"{p}_ms"], keepdims=1),
        eps,
        helper.make_node("Add", [f"{p}_ms", f"{p}_eps"], [f"{p}_var"]),
        helper.make_node("Sqrt", [f"{p}_var"], [f"{p}_std"]),
        helper.make_node("Reciprocal", [f"{p}_std"], [f"{p}_inv"]),
        helper.make_node("Mul", [f"{p}_f", f"{p}_inv"], [f"{p}_n"]),
        helper.make_node("CastLike", [f"{p}_n", x], [f"{p}_c"]),
        helper.make_node("Mul", [w, f"{p}_c"], [f"{p}_out"]),
    ]


def function_body(opset: int = 18) -> onnx.FunctionProto:
    """MlpExpand in standard ONNX ops, the same composition as the PyTorch reference."""
    nodes = [
        _const_ints("axis_last", [-1]),
        _const_ints("one", [1]),
        _const_ints("big", [2**62]),
        _const_ints("zero", [0]),
        helper.make_node("Gather", ["embed_weight", "parent_ids"], ["e"], axis=0),  # [B-1, M, H]
        *_rms_norm("e", "head_norm_weight", "head_eps", "en"),
        *_rms_norm("z", "norm_weight", "norm_eps", "zn"),
        helper.make_node("Slice", ["zn_out", "one", "big", "zero"], ["h2"]),  # norm(z)[1:]
        helper.make_node("Unsqueeze", ["h2", "one"], ["h3"]),
        helper.make_node("Shape", ["e"], ["e_shape"]),
        helper.make_node("Expand", ["h3", "e_shape"], ["h"]),
        helper.make_node("Concat", ["en_out", "h"], ["x3"], axis=-1),
        helper.make_node("Flatten", ["x3"], ["x"], axis=2),  # [R, 2H]
        helper.make_node("Gemm", ["x", "ug_weight", "ug_bias"], ["ug"], transB=1),
        helper.make_node("Split", ["ug"], ["u", "g"], axis=-1, num_outputs=2),
        helper.make_node("Sigmoid", ["g"], ["g_sig"]),
        helper.make_node("Mul", ["g", "g_sig"], ["g_act"]),
        helper.make_node("Mul", ["g_act", "u"], ["act"]),
        helper.make_node("Gemm", ["act", "d_weight"], ["delta2"], transB=1),
        helper.make_node("Reshape", ["delta2", "e_shape"], ["delta"]),
        helper.make_node("Slice", ["z", "one", "big", "zero"], ["zt"]),
        helper.make_node("Unsqueeze", ["zt", "one"], ["zt3"]),
        helper.make_node("Add", ["zt3", "delta"], ["y"]),
        *_rms_norm("y", "norm_weight", "norm_eps", "yn"),
        helper.make_node("Identity", ["yn_out"], ["out"]),
    ]
    return helper.make_function(DOMAIN, OP_TYPE, list(INPUTS), ["out"], nodes,
                                [helper.make_opsetid("", opset)],
                                attributes=[*FLOAT_ATTRS, "plugin_namespace", "plugin_version"])


def uses_custom_ops(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN for n in model.graph.node)


def with_function_bodies(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model that ONNX Runtime can run: the custom node's body attached as a
    model-local function (ONNX Runtime inlines it)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not any(f.domain == DOMAIN and f.name == OP_TYPE for f in out.functions):
        opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 18)
        out.functions.append(function_body(opset))
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    return out


def inline_custom_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """The plugin-free form of a plugin graph (standard ops only), e.g. for the TensorRT-RTX builder,
    which has no plugin API."""
    from onnx import inliner

    inlined = inliner.inline_local_functions(with_function_bodies(model))
    del inlined.functions[:]
    kept = [o for o in inlined.opset_import if o.domain != DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    return inlined


# TensorRT's ahead-of-time plugins launch exactly one kernel each, so for TensorRT the
# single MlpExpand node becomes one plugin node per kernel (see treeflash_kernels.mlp_expand).
STAGES = {  # op_type -> (inputs, output dtype: "T" = z's dtype or float32)
    "ExpandPrologue": (("z", "parent_ids", "embed_weight", "head_norm_weight", "norm_weight"), "T"),
    "SwigluGemm": (("x", "ug_weight", "ug_bias"), "T"),
    "DownResidual": (("act", "d_weight", "z"), "float32"),  # attribute top_m: rows per block position
    "RmsNorm": (("y", "norm_weight"), "T"),
}


def split_for_tensorrt(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every MlpExpand node replaced by its four single-kernel plugin nodes
    (ExpandPrologue -> SwigluGemm -> DownResidual -> RmsNorm) and a Reshape to [B-1, M, H]."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    shapes = _static_shapes(out)
    nodes = []
    for i, node in enumerate(out.graph.node):
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            nodes.append(node)
            continue
        args = dict(zip(INPUTS, node.input))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        p = f"{node.name or 'mlp_expand'}_{i}"
        ids_shape = shapes.get(args["parent_ids"])
        if not ids_shape or len(ids_shape) != 2 or not isinstance(ids_shape[1], int):
            raise ValueError(f"{node.name}: the parent ids need a static shape [B-1, M], found {ids_shape}")
        plug = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
        nodes += [
            helper.make_node("ExpandPrologue", [args[n] for n in STAGES["ExpandPrologue"][0]], [f"{p}_x"],
                             name=f"{p}_prologue", domain=DOMAIN, head_eps=attrs["head_eps"],
                             norm_eps=attrs["norm_eps"], **plug),
            helper.make_node("SwigluGemm", [f"{p}_x", args["ug_weight"], args["ug_bias"]], [f"{p}_act"],
                             name=f"{p}_swiglu", domain=DOMAIN, **plug),
            helper.make_node("DownResidual", [f"{p}_act", args["d_weight"], args["z"]], [f"{p}_y"],
                             name=f"{p}_down", domain=DOMAIN, top_m=ids_shape[1], **plug),
            helper.make_node("RmsNorm", [f"{p}_y", args["norm_weight"]], [f"{p}_out2"], name=f"{p}_norm",
                             domain=DOMAIN, eps=attrs["norm_eps"], **plug),
            helper.make_node("Shape", [args["parent_ids"]], [f"{p}_bm"]),
            helper.make_node("Shape", [args["z"]], [f"{p}_h"], start=1),
            helper.make_node("Concat", [f"{p}_bm", f"{p}_h"], [f"{p}_shape"], axis=0),
            helper.make_node("Reshape", [f"{p}_out2", f"{p}_shape"], [node.output[0]], name=f"{p}_reshape"),
        ]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _static_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """name -> dims (int, or the symbol / None when dynamic) of every typed value after shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    return out


def ort_session(path, options=None, providers=None):
    """An ONNX Runtime session for an exported graph; plugin graphs get their function bodies
    attached in memory (the file on disk is not changed)."""
    import os
    import tempfile

    import onnxruntime as ort

    providers = providers or ["CPUExecutionProvider"]
    model = onnx.load(str(path), load_external_data=False)
    if not uses_custom_ops(model):
        return ort.InferenceSession(str(path), options, providers=providers)
    model = with_function_bodies(model)
    external = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    if not external:
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    # External weights are found relative to the model file: run from a folder that links to them.
    with tempfile.TemporaryDirectory(prefix="treeflash-ort-") as tmp:
        for name in external:
            os.symlink(os.path.abspath(os.path.join(os.path.dirname(str(path)), name)), os.path.join(tmp, name))
        onnx.save(model, os.path.join(tmp, "model.onnx"))
        return ort.InferenceSession(os.path.join(tmp, "model.onnx"), options, providers=providers)
