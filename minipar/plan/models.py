"""The model the planner sizes: a GPT given by its shapes, its parameter count, named presets.

``GPTShape(layers, hidden, heads, seq, vocab)`` is minipar's ``nn.GPT`` by default (GPT-2:
LayerNorm with bias, a GeLU MLP of 4·hidden, learned positions, the LM head untied), and its
``parameters()`` is the count that model has, to the parameter. ``style="llama"`` is Llama's
block instead (RMSNorm, SwiGLU, no biases, rotary positions), ``kv_heads`` its grouped-query
attention, ``experts``/``top_k`` minipar's ``nn.MoEBlock`` (a router and E expert MLPs).

    shape = PRESETS["gpt3-175b"].shape
    shape.parameters()                       # 174_604_259_328: GPT-3's paper prints 175.0B
"""
import dataclasses

STYLES = ("gpt2", "llama")


@dataclasses.dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = None        # the MLP's inner width; None: 4·hidden (GPT-2, Megatron)
    kv_heads: int = None   # key/value heads (grouped-query attention); None: heads
    experts: int = 0       # 0: a dense MLP; E >= 1: a router and E expert MLPs per layer
    top_k: int = 1         # experts each token goes to (sizes compute, not parameters)
    style: str = "gpt2"
    tied: bool = False     # the LM head shares the token embedding (GPT-2's, Megatron's)

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"GPTShape: style={self.style!r}: the planner models {STYLES}")
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTShape: {name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv:
            raise ValueError(f"GPTShape: hidden={self.hidden}, heads={self.heads}, kv_heads="
                             f"{self.kv}: heads must divide hidden and kv_heads divide heads")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"GPTShape: top_k={self.top_k} must be in 1..experts="
                             f"{self.experts}")

    @property
    def inner(self):
        """The MLP's inner width."""
        return self.ffn or 4 * self.hidden

    @property
    def kv(self):
        """Key/value heads."""
        return self.kv_heads or self.heads

    def layer_parameters(self):
        """Parameters of one transformer block: attention, MLP (or router and experts), norms."""
        h, f, bias = self.hidden, self.inner, self.style == "gpt2"
        qkv = h + 2 * self.kv * (h // self.heads)  # q is h wide; k and v kv_heads·d each
        # c_attn (h -> qkv) and c_proj (h -> h), with biases in GPT-2
        attention = h * qkv + h * h + (qkv + h if bias else 0)
        if self.style == "gpt2":
            mlp = h * f + f + f * h + h    # c_fc and c_proj, with biases
            norms = 2 * 2 * h              # ln_1 and ln_2: a weight and a bias each
        else:
            mlp = 3 * h * f                # SwiGLU: gate, up and down, no biases
            norms = 2 * h                  # two RMSNorms: a weight each
        if self.experts:
            mlp = self.experts * mlp + h * self.experts  # E experts and the router (no bias)
        return attention + mlp + norms

    def parameters(self):
        """Every parameter: embeddings, the blocks, the final norm, the LM head (unless tied)."""
        h = self.hidden
        positions = self.seq * h if self.style == "gpt2" else 0  # wpe; rotary has none
        final_norm = 2 * h if self.style == "gpt2" else h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + positions + self.layers * self.layer_parameters() \
            + final_norm + head


@dataclasses.dataclass(frozen=True)
class Preset:
    """A published model and, where its paper gives them, the run: sequences per iteration
    (``global_batch``), the tensor and pipeline degrees and the GPU count (dp = gpus/(tp·pp));
    ``billions`` and ``tflops`` (model TFLOP/s per GPU) as the paper prints them."""
    shape: GPTShape
    global_batch: int = None
    tp: int = None
    pp: int = None
    gpus: int = None
    billions: str = None
    tflops: str = None
    source: str = ""

    @property
    def dp(self):
        """The data-parallel degree, gpus/(tp·pp); None where the paper gives no layout."""
        return None if self.gpus is None else self.gpus // (self.tp * self.pp)


NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1; V = 51200, s = 2048"
# (billions as printed, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU): Table 1 of
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"; every
# model uses V = 51,200 and s = 2,048 (§5.1) and ties the LM head to the embedding (the
# paper's parameter count, 12lh²(1 + 13/12h + (V + s)/12lh), counts the embedding once)
_MEGATRON = [("1.7", 24, 2304, 24, 1, 1, 32, 512, "137"),
             ("3.6", 32, 3072, 30, 2, 1, 64, 512, "138"),
             ("7.5", 32, 4096, 36, 4, 1, 128, 512, "142"),
             ("18.4", 48, 6144, 40, 8, 1, 256, 1024, "135"),
             ("39.1", 64, 8192, 48, 8, 2, 512, 1536, "138"),
             ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, "140"),
             ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, "148"),
             ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, "155"),
             ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, "163"),
             ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, "163")]

PRESETS = {
    f"megatron-{b}b": Preset(GPTShape(layers, hidden, heads, 2048, 51200, tied=True), batch,
                             tp, pp, gpus, b, tflops, NARAYANAN)
    for b, heads, hidden, layers, tp, pp, gpus, batch, tflops in _MEGATRON}
PRESETS.update({
    # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads of 128, n_ctx 2048,
    # batch 3.2M tokens (1536 sequences of 2048); V = 50257, GPT-2's BPE (§2.1: "the same
    # model and architecture as GPT-2"). The paper prints 175.0B parameters.
    "gpt3-175b": Preset(GPTShape(96, 12288, 96, 2048, 50257, tied=True), global_batch=1536,
                        billions="175.0", source="Brown et al. 2020, Table 2.1"),
    # Touvron et al. 2023 (Llama 2), Table 1: 4k context, GQA for 70B; the widths (hidden,
    # ffn 11008 / 28672, 8 kv heads, V = 32000) from the released config.json of
    # meta-llama/Llama-2-7b-hf and Llama-2-70b-hf; batch 4M tokens (§2.2) = 1024 x 4096
    "llama2-7b": Preset(GPTShape(32, 4096, 32, 4096, 32000, ffn=11008, style="llama"),
                        global_batch=1024, billions="7", source="Touvron et al. 2023"),
    "llama2-70b": Preset(GPTShape(80, 8192, 64, 4096, 32000, ffn=28672, kv_heads=8,
                                  style="llama"),
                         global_batch=1024, billions="70", source="Touvron et al. 2023"),
    # Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: layers, model dimension, FFN
    # dimension, 32/64/128 attention heads and 8 key/value heads, vocabulary 128,000 (the
    # released tokenizer's 128,256, config.json), untied head, RoPE; pre-trained at 8,192
    # tokens. §3.4.1: 405B's batch grew to 16M tokens (2,048 x 8,192), the batch taken for all
    # three (the paper gives no other); Table 4: 405B on 16,384 H100s at tp 8, cp 1, pp 16,
    # dp 128, 400 TFLOP/s per GPU (41 % BF16 MFU). Parameters: 8,030,261,248 / 70,553,706,496
    # / 405,853,388,800 (the paper's 8B, 70B, 405B; the model cards' 8.03B, 70.6B, 405.9B)
    "llama3-8b": Preset(GPTShape(32, 4096, 32, 8192, 128256, ffn=14336, kv_heads=8,
                                 style="llama"), global_batch=2048, billions="8.03",
                        source="Dubey et al. 2024, Table 3"),
    "llama3-70b": Preset(GPTShape(80, 8192, 64, 8192, 128256, ffn=28672, kv_heads=8,
                                  style="llama"), global_batch=2048, billions="70.6",
                         source="Dubey et al. 2024, Table 3"),
    "llama3-405b": Preset(GPTShape(126, 16384, 128, 8192, 128256, ffn=53248, kv_heads=8,
                                   style="llama"), global_batch=2048, tp=8, pp=16, gpus=16384,
                          billions="405.9", tflops="400",
                          source="Dubey et al. 2024, Tables 3 and 4"),
})


def preset(name):
    """The named ``Preset``; an unknown name is a KeyError listing the known ones."""
    if name not in PRESETS:
        raise KeyError(f"no preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
