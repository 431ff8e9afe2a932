"""Day 5's language model: a small decoder-only GPT laid out and named as Hugging Face's Llama (lessons 22-23),
its parts in the order its constructor makes them (for course/training/sharded_init.py's init_shards), and its
command-line sizes.

Apart from course/models.py (days 1-4's models) so that the lessons and notebooks of days 1-4 import nothing of it.
"""
import torch
from torch import nn

class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) as Hugging Face's Llama computes it: each query and key is rotated by
    an angle that grows with its position, in pairs of features (i, i + head_width / 2), so that attention
    sees how far apart two tokens are.  No parameters: the angles are computed from `theta` each time."""

    def __init__(self, head_width: int, theta: float = 10000.0):
        super().__init__()
        self.head_width, self.theta = head_width, theta

    def forward(self, x, positions):  # x: [batch, heads, tokens, head_width]
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_width, 2, device=x.device, dtype=torch.float32)
                                         / self.head_width))
        angles = positions.float()[:, None] * inv_freq[None, :]  # [tokens, head_width / 2]
        cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention: each token attends to itself and the tokens before it.  q, k and v are three
    matrices whose rows are ordered head by head, so a cut of each into T equal pieces of rows (tensor
    parallelism's ColwiseParallel) holds whole heads; the number of heads is read from the tensor (`-1`), so
    the same code runs on all heads or on a rank's share."""

    def __init__(self, width: int, heads: int, theta: float):
        super().__init__()
        self.head_width = width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.rotary = RotaryEmbedding(self.head_width, theta)

    def forward(self, x):
        b, t = x.shape[:2]
        q, k, v = (proj(x).view(b, t, -1, self.head_width).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [b, heads, t, head_width]
        positions = torch.arange(t, device=x.device)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Llama's gated MLP (SwiGLU): down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)).  The unit FSDP2 shards and
    activation checkpointing recomputes."""

    def __init__(self, width: int, heads: int, hidden: int, theta: float, eps: float):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(width, eps=eps)
        self.self_attn = Attention(width, heads, theta)
        self.post_attention_layernorm = nn.RMSNorm(width, eps=eps)
        self.mlp = MLP(width, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


GPT_DEFAULTS = dict(vocab=256, width=64, depth=2, heads=4, hidden=172, theta=10000.0, eps=1e-5)


def gpt_parts(vocab=256, width=64, depth=2, heads=4, hidden=172, theta=10000.0, eps=1e-5):
    """The GPT's parts as (name, module), in the order its constructor makes them and so draws their random
    numbers (as course/models.py's vit_parts): made one at a time under the seed of a whole GPT, each has that
    GPT's weights.
    Initialized as Hugging Face's Llama initializes: every matrix and the embedding from N(0, 0.02), the norms 1."""
    if width % heads or (width // heads) % 2:
        raise ValueError(f"width {width} must be a multiple of heads {heads} with an even head width")

    def normal(module):
        for p in module.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        return module

    yield "model", nn.Module()
    yield "model.embed_tokens", normal(nn.Embedding(vocab, width))
    yield "model.layers", nn.ModuleList()
    for i in range(depth):
        yield f"model.layers.{i}", normal(DecoderLayer(width, heads, hidden, theta, eps))
    yield "model.norm", nn.RMSNorm(width, eps=eps)
    yield "lm_head", normal(nn.Linear(width, vocab, bias=False))


class GPT(nn.Module):
    """A small decoder-only language model (a GPT) laid out as Hugging Face's Llama: token embedding, `depth`
    pre-norm blocks of causal attention with rotary positions and a gated MLP, a final RMSNorm, a head that
    gives each position's logits over the vocabulary (not tied to the embedding).  Its parameters carry
    Llama's names (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ..., lm_head.weight) and
    shapes: its state dict is that of a LlamaForCausalLM of LlamaConfig(vocab_size=256, hidden_size=64,
    intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False) at the default size (Llama's default eps is 1e-6; no rope
    scaling, as many heads of keys and values as of queries).  Hugging Face's RMSNorm computes in float32 and
    casts back; nn.RMSNorm computes in the input's dtype: the same in float32.  Default size (a byte vocabulary
    of 256, width 64, depth 2, 4 heads, MLP hidden 172): 131 904 parameters."""

    def __init__(self, **sizes):
        super().__init__()
        self.sizes = {**GPT_DEFAULTS, **sizes}
        for name, part in gpt_parts(**self.sizes):
            parent, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(parent), leaf, part)

    def forward(self, tokens):  # [batch, tokens] -> [batch, tokens, vocab]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def gpt_sizes(args) -> dict:
    """The GPT's sizes from day 5's flags (add_gpt_args)."""
    return dict(GPT_DEFAULTS, width=args.width, depth=args.depth, heads=args.heads, hidden=args.hidden)


def add_gpt_args(p):
    from course.launching.cli import positive_int

    p.add_argument("--width", type=positive_int, default=64, help="features per token (a multiple of --heads)")
    p.add_argument("--depth", type=positive_int, default=2, help="decoder blocks")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads per block")
    p.add_argument("--hidden", type=positive_int, default=172, help="the MLP's hidden features")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens (bytes) per sequence")
    return p


def check_gpt_args(args) -> None:
    from course.launching.cli import CourseError

    if args.width % args.heads or (args.width // args.heads) % 2:
        raise CourseError(f"--width {args.width} must be a multiple of --heads {args.heads} with an even width per "
                          f"head (rotary positions turn features in pairs); choose a width such as {args.heads * 16}")
