"""The LLaMA family: RMSNorm, real-valued RoPE, grouped-query attention, SwiGLU; with Qwen2's q/k/v
biases, Qwen3's per-head q/k norms and decoupled head_dim, and Mistral's sliding window as switches.

Parameter names follow torchtitan (``tok_embeddings``, ``layers.N.attention.wq``, ...) but the
q/k rows are in Hugging Face's rotate-half RoPE layout, so a unified checkpoint maps to
``LlamaForCausalLM`` by renaming alone. Layers live in a ModuleDict keyed by their global id, so a
pipeline stage that keeps layers 4..7 still names them ``layers.4`` .. ``layers.7``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_pipe.model import features, rope
from titan_pipe.model.features import gates
from titan_pipe.model.features.gates import Gate
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.kernels import Kernels, norm_for, reference_kernels
from titan_pipe.model.lora import LoRASpec, is_adapter
from titan_pipe.model.lora_modules import adapted, adapters_for, init_adapter
from titan_pipe.model.loss import cross_entropy, linear_cross_entropy
from titan_pipe.model.params import param_of
from titan_pipe.model.seeding import param_generator


# ---------------------------------------------------------------------------------------------
# RoPE: real-valued, rotate-half layout


def rope_inv_freq(args: ModelArgs, table: features.RopeTable | None = None) -> torch.Tensor:
    """(head_dim/2,) inverse frequencies of ``table`` (None: the main one), with the configured
    scaling where it takes it (titan_pipe.model.rope)."""
    return torch.as_tensor(rope.inv_freq(args, table))  # on the default device (meta while building on meta)


def rope_cos_sin(
    args: ModelArgs, seq_len: int | None = None, table: features.RopeTable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim), each half repeated (rotate-half convention), of
    ``table`` (one of features.rope_tables; None: the main one)."""
    t = torch.arange(seq_len or args.max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(args, table))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


# ---------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    """``offset``: Gemma's norm, its weight an offset from 1 (kernels.rms_norm_offset)."""

    def __init__(self, dim: int, eps: float, kernels: Kernels, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.norm = norm_for(kernels, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


def _norm(args: ModelArgs, dim: int, kernels: Kernels) -> RMSNorm:
    return RMSNorm(dim, args.norm_eps, kernels, features.offset_norms(args))


class Attention(nn.Module):
    """GQA attention. Under TP, wq/wk/wv (and their biases) are column-split (local heads), wo
    row-split, the q/k norms replicated over the local heads. ``lora``: adapters beside the
    targeted projections (titan_pipe.model.lora)."""

    def __init__(self, args: ModelArgs, kernels: Kernels, lora: LoRASpec | None = None, layer_id: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.window = args.layer_window(layer_id)
        self.scale = features.attention_scale(args)
        self.wq = nn.Linear(args.dim, args.q_dim, bias=features.biased(args, "q"))
        self.wk = nn.Linear(args.dim, args.kv_dim, bias=features.biased(args, "k"))
        self.wv = nn.Linear(args.dim, args.kv_dim, bias=features.biased(args, "v"))
        self.wo = nn.Linear(args.q_dim, args.dim, bias=False)
        # the features on the heads of q, k, v (titan_pipe.model.features): each builds its own parameters
        self.features = tuple(f for f in features.active(args) if f.attention_heads is not None)
        for f in self.features:
            f.build_attention(self, args, lambda width: _norm(args, width, kernels))
        self.lora = adapters_for(
            "attention",
            {
                "wq": (args.dim, args.q_dim),
                "wk": (args.dim, args.kv_dim),
                "wv": (args.dim, args.kv_dim),
                "wo": (args.q_dim, args.dim),
            },
            lora,
        )
        self.kernels = kernels

    def _heads(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """(B, T, dim) -> (B, heads, T, hd) through projection w``part``; the features see (B, T, heads, hd),
        heads last but one (the dim tensor parallelism splits them on)."""
        b, t, _ = x.shape
        name = f"w{part}"
        y = adapted(getattr(self, name), self.lora, name, x).view(b, t, -1, self.head_dim)
        for f in self.features:
            y = f.attention_heads(self, part, y)
        return y.transpose(1, 2)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, dim) -> q (B, H, T, hd), k and v (B, Hkv, T, hd), RoPE applied to q and k.

        Head counts come from the (possibly TP-local) weight shapes, hence ``-1`` in the views.
        """
        q, k, v = self._heads("q", x), self._heads("k", x), self._heads("v", x)
        q, k = self.kernels.apply_rotary(q, k, cos, sin)
        return q, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if positions is None:
            out = self.kernels.attention(q, k, v, n_rep=self.n_rep, causal=True, window=self.window, **self._scale())
        else:  # packed documents: each query sees its own document only
            out = self.kernels.attention(
                q, k, v, n_rep=self.n_rep, causal=True, window=self.window, positions=positions, **self._scale()
            )
        return adapted(self.wo, self.lora, "wo", out.transpose(1, 2).reshape(b, t, -1))

    def _scale(self) -> dict:
        """The attention kwarg of a scale other than head_dim^-1/2 (Gemma 3's query_pre_attn_scalar)."""
        return {} if self.scale is None else {"scale": self.scale}


class FeedForward(nn.Module):
    """A gated MLP: w2(gate(w1 x) * w3 x), the gate one kind of titan_pipe.model.features.gates
    (SwiGLU's silu, Gemma's GeGLU); ``lora``: adapters beside the targeted ones."""

    def __init__(self, dim: int, hidden_dim: int, lora: LoRASpec | None = None, gate: Gate = gates.DEFAULT):
        super().__init__()
        self.gate = gate.torch_gate  # (F, x) -> gate(x)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.lora = adapters_for(
            "feed_forward", {"w1": (dim, hidden_dim), "w3": (dim, hidden_dim), "w2": (hidden_dim, dim)}, lora
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.w2(self.gate(F, self.w1(x)) * self.w3(x))
        h = self.gate(F, adapted(self.w1, self.lora, "w1", x)) * adapted(self.w3, self.lora, "w3", x)
        return adapted(self.w2, self.lora, "w2", h)


class Experts(nn.Module):
    """``n`` SwiGLU experts, their weights stacked: w1, w3 (n, hidden, dim), w2 (n, dim, hidden)."""

    def __init__(self, n: int, dim: int, hidden: int, kernels: Kernels):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.kernels = kernels
        # Set by the trainer under expert parallelism (training/expert_parallel.py): runs the
        # experts on the ranks that hold them; None: all experts are here.
        self.dispatch = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim): tokens sorted by expert, counts[e] of them for expert e -> (N, dim)."""
        if self.dispatch is not None:
            return self.dispatch(x, counts, self.w1, self.w3, self.w2, self.kernels.experts)
        return self.kernels.experts(x, counts, *(_local(w) for w in (self.w1, self.w3, self.w2)))


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: under tensor parallelism the experts are Replicate DTensors (every
    tp rank runs all of them on the same tokens, so their gradients agree and need no reduction)."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class Router(nn.Module):
    """The router of a mixture of experts: one linear map to the experts' logits (``gate``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, features.routing(args).experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


class MoE(nn.Module):
    """A mixture of experts in place of the feed-forward (Mixtral, Qwen3-MoE): the router's softmax
    over the experts, the top k of them per token (their probabilities renormalized to sum to 1 where
    the model's Routing says so), each token's output the so-weighted sum of its experts' outputs.

    Each forward keeps the router statistics of its tokens (``balance``: assignments per expert, the
    sum of the probabilities per expert, the token count) for the load-balancing loss
    (``load_balancing_loss``)."""

    def __init__(self, args: ModelArgs, kernels: Kernels):
        super().__init__()
        self.routing = features.routing(args)  # features/experts.py: what a routing layer computes with
        self.router = Router(args)
        self.experts = Experts(self.routing.experts, args.dim, self.routing.width, kernels)
        self.balance: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # evaluate's reference sets keep_choices: the last forward's experts per token (N, k) are then
        # kept in ``chosen`` (training does not keep them: one (N, k) tensor a layer for nothing)
        self.keep_choices = False
        self.chosen: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> (probabilities (N, E) float32, chosen experts (N, k), their weights (N, k) float32)."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.routing.top_k, dim=-1)
        if self.routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, chosen, weights = self.route(flat)
        if self.keep_choices:
            self.chosen = chosen.detach()
        assigned = chosen.reshape(-1)
        counts = torch.bincount(assigned, minlength=self.routing.experts)
        self.balance = (counts.float(), probs.sum(dim=0), flat.shape[0])
        order = assigned.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        token = order // self.routing.top_k
        y = self.experts(flat[token], counts)
        y = (y.float() * weights.reshape(-1)[order, None]).to(flat.dtype)
        return torch.zeros_like(flat).index_add_(0, token, y).view(shape)


class TransformerBlock(nn.Module):
    """Attention and a feed-forward: the dense gated MLP, or in a routing layer of a mixture-of-experts
    model (ModelArgs.is_moe_layer) the MoE (``moe``; ``feed_forward`` is then None). A feature may
    hold modules of the block's own and change what a sub-layer's output adds to the residual
    (``sublayer_output``: Gemma 3's norms on the outputs; titan_pipe.model.features)."""

    def __init__(self, args: ModelArgs, kernels: Kernels, layer_id: int = 0, lora: LoRASpec | None = None):
        super().__init__()
        self.attention_norm = _norm(args, args.dim, kernels)
        self.attention = Attention(args, kernels, lora, layer_id)
        self.ffn_norm = _norm(args, args.dim, kernels)
        routed = args.is_moe_layer(layer_id)
        self.feed_forward = None if routed else FeedForward(args.dim, args.hidden_dim, lora, gates.gate_of(args))
        self.moe = MoE(args, kernels) if routed else None
        self.features = tuple(f for f in features.active(args) if f.sublayer_output is not None)
        for f in self.features:
            f.build_block(self, args, lambda width: _norm(args, width, kernels))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        a = self.attention(self.attention_norm(x), cos, sin, positions)  # 4 inputs always (TP's input plan)
        h = x + self.sublayer_output("attention", a)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + self.sublayer_output("mlp", ffn(self.ffn_norm(h)))

    def sublayer_output(self, part: str, y: torch.Tensor) -> torch.Tensor:
        """Sub-layer ``part``'s output (attention, mlp) as its residual add takes it."""
        for f in self.features:
            y = f.sublayer_output(self, part, y)
        return y


def load_balancing_loss(moes: list[MoE], reduce=None) -> torch.Tensor | None:
    """The load-balancing loss of the last forward through ``moes`` (Switch Transformer's, as
    transformers computes it for Mixtral and Qwen3-MoE): E (the experts) x sum over experts of (the share
    of top-k assignments it got) x (its mean router probability), both over every routing layer's
    tokens. None without routing layers or before a forward.

    ``reduce(assigned, prob_sum, rows) -> (assigned, prob_sum, rows, scale)``: the statistics of
    the whole data-parallel batch (the trainer's all-reduce; another rank's part of ``prob_sum``
    enters as a constant), and the factor that makes the gradient of this rank's share exact once
    data parallelism averages the ranks' gradients. The loss is then the one a single process
    computes over the whole batch, not a mean of per-rank losses."""
    stats = [m.balance for m in moes if m.balance is not None]
    if not stats:
        return None
    assigned = sum(c for c, _, _ in stats)
    prob = sum(p for _, p, _ in stats)
    return balance_loss(assigned, prob, sum(n for _, _, n in stats), moes[0].routing.experts, reduce)


def balance_loss(assigned: torch.Tensor, prob: torch.Tensor, rows, experts: int, reduce=None) -> torch.Tensor:
    """load_balancing_loss from its statistics summed over the routing layers: top-k assignments per
    expert, router probability summed per expert, (token, layer) rows. A pipeline carries the first
    two from stage to stage (Transformer.carry_balance) and its last stage calls this."""
    scale = 1
    if reduce is not None:
        assigned, prob, rows, scale = reduce(assigned, prob, rows)
    loss = ((assigned / rows) * (prob / rows)).sum() * experts
    return loss if scale == 1 else loss.detach() + scale * (loss - loss.detach())


def scale_embeddings(h: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The embedding rows as the first layer takes them: each feature's ``embed`` (titan_pipe.model.features)."""
    for f in features.active(args):
        if f.embed is not None:
            h = f.embed(h, args)
    return h


class Transformer(nn.Module):
    """Decoder-only LLaMA. forward(tokens (B, T) int64) -> logits (B, T, vocab).

    A pipeline stage is the same class with some parts set to None: without ``tok_embeddings`` the
    input is the hidden state (B, T, dim); without ``output`` the result is the hidden state.
    ``lora``: LoRA adapters beside the targeted linears of every layer (titan_pipe.model.lora).
    """

    def __init__(self, args: ModelArgs, kernels: Kernels | None = None, lora: LoRASpec | None = None):
        super().__init__()
        self.args, self.lora = args, lora
        kernels = kernels or reference_kernels()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, kernels, i, lora) for i in range(args.n_layers)})
        self.norm = _norm(args, args.dim, kernels)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.share_tensors()
        # Under sequence parallel (training/tensor_parallel.py) the residual stream holds T/tp
        # positions per rank while attention sees all T: RoPE tables are cut to T = local * this.
        self.seq_shards = 1
        # Set by the trainer under data parallelism: the batch-wide statistics of the load-balancing
        # loss (load_balancing_loss's ``reduce``).
        self.balance_reduce = None
        # Set by the trainer on the stages of a pipeline of a mixture of experts: forward takes and
        # returns the routing statistics so far (assignments, probability sums per expert) beside the
        # hidden state, so the last stage computes the load-balancing loss of every stage's routers
        # and its gradient flows back to each (balance_loss).
        self.carry_balance = False
        self.loss_chunk = None  # the fused loss's chunk step when compiled (model.loss.CompiledLoss); None: eager
        # one (rope_cos<suffix>, rope_sin<suffix>) buffer pair per table (features.rope_tables)
        self.rope_tables = features.rope_tables(args)
        self.layer_rope = tuple(features.layer_rope(args, i) for i in range(args.n_layers))  # each layer's table
        self.routing = features.routing(args)  # a mixture of experts' (features/experts.py); None: dense
        for table in self.rope_tables:
            cos, sin = rope_cos_sin(args, table=table)
            self.register_buffer(f"rope_cos{table.suffix}", cos, persistent=False)
            self.register_buffer(f"rope_sin{table.suffix}", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        *carry: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        loss_denom: float | None = None,
    ):
        """Logits (or, without ``output``, the hidden state); with ``labels``, the mean cross entropy
        instead, fused with the output projection in chunks (titan_pipe.model.loss) so the float32
        logits never exist, unless the output weight is tensor-parallel (then from full logits).

        ``positions`` (B, T): packed documents (fine-tuning): RoPE positions restart at each, and
        attention stays inside each. Labels -100 are not learned; ``loss_denom``: the loss is the
        sum over the other labels divided by it (the global batch's target count), not their mean.

        With ``carry_balance`` (a pipeline stage of a mixture of experts): ``carry`` is the routing
        statistics of the stages before (none on the first) and the result is (logits or hidden
        state, assignments, probability sums) with this stage's routers' added."""
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        tables = {
            t.name: self._rope(getattr(self, f"rope_cos{t.suffix}"), getattr(self, f"rope_sin{t.suffix}"), h, positions)
            for t in self.rope_tables
        }
        for lid, layer in self.layers.items():
            h = layer(h, *tables[self.layer_rope[int(lid)]], positions)
        h = self.norm(h) if self.norm is not None else h
        if self.carry_balance:
            return (self.output(h) if self.output is not None else h, *self._carried(carry, h))
        if labels is None:
            return self.output(h) if self.output is not None else h
        from torch.distributed.tensor import DTensor

        if isinstance(self.output.weight, DTensor) or isinstance(h, DTensor):
            loss = cross_entropy(self.output(h), labels, denom=loss_denom)
        else:
            loss = linear_cross_entropy(h, self.output.weight, labels, denom=loss_denom, chunk=self.loss_chunk)
        aux = self.aux_loss()
        return loss if aux is None else loss + aux

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``tokens`` (scaled: ``scale_embeddings``)."""
        return scale_embeddings(self.tok_embeddings(tokens), self.args)

    def _rope(
        self, cos: torch.Tensor, sin: torch.Tensor, h: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for this forward: the first T (T/tp shards under sequence parallel), or per row
        at ``positions``, (B, 1, T, hd), broadcast over the heads."""
        if positions is None:
            t = h.shape[1] * self.seq_shards
            return cos[:t].to(h.dtype), sin[:t].to(h.dtype)
        return cos[positions][:, None].to(h.dtype), sin[positions][:, None].to(h.dtype)

    def _carried(self, carry: tuple, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing statistics so far (``carry``, zeros on the first stage) plus this stage's."""
        n = self.routing.experts
        assigned, prob = carry if carry else (torch.zeros(n, device=h.device), torch.zeros(n, device=h.device))
        for layer in self.layers.values():
            if layer.moe is not None and layer.moe.balance is not None:
                assigned = assigned + layer.moe.balance[0]
                prob = prob + layer.moe.balance[1]
        return assigned, prob

    def aux_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing loss of the last forward (router_aux_loss_coef x
        load_balancing_loss), added to the training loss; None for a dense model or a zero weight."""
        moes = [layer.moe for layer in self.layers.values() if layer.moe is not None]
        if not moes or not self.args.router_aux_loss_coef:
            return None
        balance = load_balancing_loss(moes, self.balance_reduce)
        return None if balance is None else self.args.router_aux_loss_coef * balance

    def share_tensors(self) -> None:
        """Each parameter a feature makes one with another (features.shared: the tied head) becomes
        that other Parameter: one tensor, one gradient."""
        for name, source in features.shared(self.args).items():
            owner, _, attr = name.rpartition(".")
            setattr(self.get_submodule(owner), attr, self.get_parameter(source))

    def init_rope(self, device: str | torch.device | None = None) -> None:
        """Recompute the RoPE buffers (after building on the meta device), on ``device`` (None: where they are)."""
        device = self.rope_cos.device if device is None else device
        for table in self.rope_tables:
            cos, sin = rope_cos_sin(self.args, table=table)
            setattr(self, f"rope_cos{table.suffix}", cos.to(device))
            setattr(self, f"rope_sin{table.suffix}", sin.to(device))


def _param_std(name: str, args: ModelArgs) -> float | None:
    """Init std of a parameter by its declared init (titan_pipe.model.params); None: ones or zeros."""
    init = param_of(name).init
    if init in ("ones", "zeros"):  # an offset norm (Gemma) starts at 0: a scale of 1
        return None
    if init == "depth_scaled":  # projections back into the residual stream, scaled by depth
        return 0.02 / math.sqrt(2 * args.n_layers)
    if init == "fan_in":
        return args.dim**-0.5
    return 0.02


def init_param(
    name: str, shape: tuple[int, ...], args: ModelArgs, seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The full (global) initial value of one parameter, independent of any parallel layout.

    Each parameter has its own generator seeded from (seed, name), so a pipeline stage or a TP
    rank gets exactly the values the single-process model would hold. An adapter weight starts as
    titan_pipe.model.lora_modules.init_adapter's default (PEFT's).
    """
    if is_adapter(name):
        return init_adapter(name, shape, seed).to(dtype)
    std = _param_std(name, args)
    if std is None:
        ones = param_of(name).init == "ones" and not features.offset_norms(args)
        return (torch.ones if ones else torch.zeros)(shape, dtype=dtype)
    g = param_generator(seed, name)
    t = torch.empty(shape, dtype=torch.float32)
    t.normal_(0.0, std, generator=g)
    t.clamp_(-3 * std, 3 * std)
    return t.to(dtype)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialise every (plain, non-DTensor) parameter in place, layout-independently."""
    for name, p in model.named_parameters():
        p.copy_(init_param(name, tuple(p.shape), model.args, seed, p.dtype))


def build_model(
    args: ModelArgs,
    *,
    kernels: Kernels | None = None,
    seed: int | None = 0,
    device: str | torch.device = "cpu",
    lora: LoRASpec | None = None,
) -> Transformer:
    """A whole model on ``device``; ``seed=None`` leaves it uninitialised (e.g. to load weights)."""
    with torch.device(device):
        model = Transformer(args, kernels, lora)
    if seed is not None and str(device) != "meta":
        init_weights(model, seed)
    return model
