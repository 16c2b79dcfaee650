"""What a prediction does not model for this request, each a sentence: ``minipar plan`` prints
them as ``note: ...`` under its table and lists them in the JSON's ``notes``.

    notes(PRESETS["llama3-8b"].shape, Layout(precision="fp8"), PROFILES["h100"])
"""


def notes(shape, layout, profile):
    """The sentences for ``shape`` planned as ``layout`` (its defaults resolved or not) on
    ``profile``."""
    L, said = layout.resolved(profile), []
    if profile.engine is not None and L.precision != "fp32":
        # here's engine is timed in float32 only (NumPy's bfloat16 is an emulation)
        said.append(f"--profile here times minipar's engine in float32: a {L.precision} "
                    f"layout's compute and collectives are priced as float32's, its memory in "
                    f"{L.precision}")
    if shape.style == "llama":
        said.append("a Llama block's GEMMs, FLOPs and parameters are its own (SwiGLU's three "
                    "h x f matrices, grouped-query k and v of kv_heads, RMSNorm, no biases); its "
                    f"activations are counted as a GPT block's of the same s, h, a "
                    f"({L.activations}'s model), ZeRO-3's units as a GPT block's six")
    if profile.engine is None and 5 * shape.heads * shape.seq > 34 * shape.hidden:
        # Korthikanti et al.'s 5as/h > 34: the scores outweigh the rest of a layer's bytes
        said.append(f"attention is priced with its s x s scores in HBM (Megatron's core "
                    f"attention), not FlashAttention's tiles: at s = {shape.seq}, {shape.heads} "
                    f"heads, its softmax's bytes outweigh the rest of a layer's")
    if L.precision == "fp8":
        said.append("fp8: the linears' GEMMs at the data sheet's dense FP8 peak (attention's "
                    "per-head products and the logits in bf16); weights in FP8 with a float32 "
                    "scale per 128 x 128 block, activations and every message (tp, cp, pp, the "
                    "gradients) in FP8 with one per 1 x 128 tile (DeepSeek-V3's fine-grained "
                    "recipe), gradients held in bf16, float32 masters and Adam moments; the "
                    "quantisation kernels' bytes are priced, FP8's accuracy is not")
    return said
