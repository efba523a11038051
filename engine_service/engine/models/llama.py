"""Llama and Qwen2 decoder over the paged KV cache.

Tokens of all sequences in a step are flattened into one [num_tokens, hidden] batch; attention
finds each token's context through AttentionMetadata. Parameter names follow the HF checkpoints;
q/k/v and gate/up are fused at load time (one matmul each instead of three / two).
"""
import torch
import torch.nn.functional as F
from torch import nn

from decodelab_kernels import cpu_layer_ops
from engine_service.engine.attention import AttentionMetadata, PagedAttention
from engine_service.engine.models.fused_decode import FusedDecode
from engine_service.engine.models.int8_linear import (
    HeadWeight,
    Int8Weight,
    generated_rows,
    projection_kernels,
    quantized,
    smoothing_scales,
)
from engine_service.engine.models.loader import head_dim as head_dim_of
from engine_service.engine.models.packed_linear import Linear, pack_weight, packed_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_layer_ops.applies(x):
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps)[1]
        if x.dtype == torch.float32:  # one fused op; same math as HF's
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, its norm): the residual add and the norm after it, one call on the CPU path."""
        if cpu_layer_ops.applies(x) and h.is_contiguous() and h.dtype == x.dtype:
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps, h)
        x = x + h
        return x, self(x)


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] for the config's theta and scaling (llama3, linear, yarn, ...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = head_dim_of(config)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        scaling = 1.0
    else:
        # no device argument: the tensors land on the current default device, like the branch above
        # (the meta device while ModelRunner builds the model; "cpu" would copy out of meta and fail)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        inv_freq = inv_freq.double()
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).float(), (emb.sin() * scaling).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos / signed_sin [N, 1, D] (`signed_sin`: sin with its first half negated).
    HF's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in 4 ops instead of 7 (a decode step
    runs this once per layer): roll(x) = [x2, x1], and the sign moves onto sin, which is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config, backend: str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.sizes = [q_size, kv_size, kv_size]
        self.attn = PagedAttention(backend, self.head_dim ** -0.5)
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        n, d, (q_size, kv_size, _) = x.shape[0], self.head_dim, self.sizes
        qkv = self.qkv_proj(x)
        # q and k are adjacent in the fused projection: rotate them in one go
        if cpu_layer_ops.applies(qkv) and d % 2 == 0:
            cpu_layer_ops.rope_(qkv, self.num_heads + self.num_kv_heads, d, cos, sin)  # in place: qkv is ours
            q, k = qkv[:, :q_size].view(n, -1, d), qkv[:, q_size:q_size + kv_size].view(n, -1, d)
        else:
            qk = apply_rope(qkv[:, :q_size + kv_size].view(n, -1, d), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, d)
        o = self.attn(q, k, v, self.k_cache, self.v_cache, meta)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_layer_ops.applies(gate_up):
            return self.down_proj(cpu_layer_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, backend: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta):
        x, y = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.mlp(y)

    @torch.no_grad()
    def smooth(self, amax: dict[nn.Module, torch.Tensor], projections=("qkv", "o", "gate_up", "down")) -> None:
        """SmoothQuant for int8 activations, the 1/s folded into the op before each matmul so it costs
        nothing per step: q/k/v and gate/up into their RMSNorm weights, o_proj into the v rows of qkv (one s
        per KV-head channel, shared by the query heads reading it), down_proj into the up rows of gate_up.
        `amax`: max |input| per channel of each matmul (CausalLM.input_absmax); `projections`: the matmuls to
        smooth (those that quantize their activations to int8)."""
        attn, mlp = self.self_attn, self.mlp
        g, d = attn.num_heads // attn.num_kv_heads, attn.head_dim

        def per_kv_channel(t: torch.Tensor) -> torch.Tensor:  # [H * D] -> [Hkv * D], max over a group's heads
            return t.view(attn.num_kv_heads, g, d).amax(dim=1).flatten()

        def scales(linear: Linear) -> torch.Tensor:
            return smoothing_scales(amax[linear], linear.weight.abs().amax(dim=0))

        # every s from the weights as loaded, before the folds change their rows and columns
        s_qkv, s_gate_up, s_down = scales(attn.qkv_proj), scales(mlp.gate_up_proj), scales(mlp.down_proj)
        s_v = smoothing_scales(per_kv_channel(amax[attn.o_proj]), per_kv_channel(attn.o_proj.weight.abs().amax(dim=0)))
        v_rows = slice(attn.sizes[0] + attn.sizes[1], None)
        if "qkv" in projections:
            _fold(self.input_layernorm.weight, s_qkv, attn.qkv_proj.weight)
        if "gate_up" in projections:
            _fold(self.post_attention_layernorm.weight, s_gate_up, mlp.gate_up_proj.weight)
        if "o" in projections:
            _fold(attn.qkv_proj.weight[v_rows], s_v, attn.o_proj.weight, s_v.view(-1, 1, d).expand(-1, g, -1).flatten())
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_rows].div_(s_v.to(attn.qkv_proj.bias.dtype))
        if "down" in projections:
            _fold(mlp.gate_up_proj.weight[mlp.down_proj.in_features:], s_down, mlp.down_proj.weight)


def _fold(before: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, s_cols: torch.Tensor | None = None) -> None:
    """Channel j of what `before` produces (an RMSNorm weight element, or row j of a projection) is divided by
    s_j and column j of the next matmul's `weight` multiplied by it (`s_cols`: the same s laid out per column)."""
    s_cols = s if s_cols is None else s_cols
    before.div_((s if before.dim() == 1 else s[:, None]).to(before.dtype))
    weight.mul_(s_cols.to(weight.dtype))


class CausalLM(nn.Module):
    def __init__(self, config, backend: str = "torch"):
        super().__init__()
        if config.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type: {config.model_type!r} is not supported (llama or qwen2)")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: torch.Tensor | None = None
        self.quantized_head: HeadWeight | Int8Weight | None = None  # quantize_int8
        self.fused_decode: FusedDecode | bool | None = None  # _fused: None until tried, False where it cannot run
        cos, sin = rope_tables(config, config.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if (fused := self._fused(input_ids, meta)) is not None:
            return fused.run(input_ids, positions, meta)  # all of the below in one C call, the same bits
        x = self.embed_tokens(input_ids)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # apply_rope's signed sin, once per step
        token = generated_rows.set(meta.num_generated)  # which rows an int8 RowSplitWeight sends where
        try:
            for layer in self.layers:
                x = layer(x, cos, sin, meta)
        finally:
            generated_rows.reset(token)
        return self.norm(x)

    def _fused(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> FusedDecode | None:
        """The one-call decode step (fused_decode.py) when this step can take it, built on first use; False in
        `fused_decode` remembers that the model as it stands cannot (quantize_int8 clears it)."""
        if self.fused_decode is False or not FusedDecode.applies(input_ids, meta):
            return None
        if self.fused_decode is None or not self.fused_decode.current(self):
            self.fused_decode = FusedDecode.build(self) or False
        return self.fused_decode or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self.tie_word_embeddings:
            if self.packed_head is not None:
                return packed_linear(hidden, self.packed_head, None).float()
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def pack_linears(self) -> None:
        """Reorders every matmul weight for oneDNN (CPU); see packed_linear.py. A tied head keeps the
        dense embedding for lookups and a packed copy for the logits."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()
        if self.tie_word_embeddings:
            self.packed_head = pack_weight(self.embed_tokens.weight)

    def quantize_int8(self, kernel: str, act_amax: dict[nn.Module, torch.Tensor] | None = None) -> None:
        """Every decoder matmul weight and the LM head to int8 (or fp16) as int8_linear.projection_kernels says
        for `kernel` (a tied head keeps the dense embedding for lookups). With `act_amax` (`input_absmax`),
        activation outliers are smoothed into the weights of the matmuls on fbgemm first (int8 activations need
        it; weight-only int8 and int16 activations do not)."""
        kernels = projection_kernels(kernel)
        self.fused_decode = None  # decided again on the next decode step
        if act_amax is not None:
            for layer in self.layers:
                layer.smooth(act_amax, [p for p, k in kernels.items() if "fbgemm" in k])
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for name, m in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                            ("down", mlp.down_proj)):
                m.quantize_int8(kernels[name])
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        self.quantized_head = quantized(head.weight, None, kernels["head"])
        if head is self.lm_head:
            head.weight = nn.Parameter(head.weight.detach().to("meta"), requires_grad=False)

    @torch.no_grad()
    def input_absmax(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> dict[nn.Module, torch.Tensor]:
        """max |x| per input channel of every decoder matmul over one forward."""
        amax: dict[nn.Module, torch.Tensor] = {}

        def record(module, args, out):
            x = args[0].detach().float().abs().amax(dim=0)
            amax[module] = torch.maximum(amax[module], x) if module in amax else x

        hooks = [m.register_forward_hook(record) for m in self.layers.modules() if isinstance(m, Linear)]
        try:
            self(input_ids, positions, meta)
        finally:
            for h in hooks:
                h.remove()
        return amax

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load an HF Llama/Qwen2 state dict, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"the config gives {tuple(own[name].shape)}")
            own[name].data.copy_(tensor)
            loaded.add(name)

        def fuse(prefix: str, parts: list[str], suffix: str, target: str) -> None:
            keys = [f"{prefix}{p}.{suffix}" for p in parts]
            if all(k in weights for k in keys):
                put(target, torch.cat([weights[k] for k in keys]))

        for name, tensor in weights.items():
            if name.startswith("model."):
                name = name[len("model."):]
            if name in own:
                put(name, tensor)
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for suffix in ("weight", "bias"):
                fuse(p + "self_attn.", ["q_proj", "k_proj", "v_proj"], suffix,
                     f"layers.{i}.self_attn.qkv_proj.{suffix}")
            fuse(p + "mlp.", ["gate_proj", "up_proj"], "weight", f"layers.{i}.mlp.gate_up_proj.weight")
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"weights: missing from the checkpoint: {sorted(missing)[:5]}")
