"""The two models of the course.  Both take [B, 1, 28, 28] images and return [B, 10] logits."""
import torch
from torch import nn


def mlp() -> nn.Module:
    """The original workshop's model: 784 -> 128 -> 10.  101 770 parameters: tiny, so communication
    is large compared with compute (lesson 7 measures what that means for scaling)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 10))


class CNN(nn.Module):
    """The convolutional classifier of PyTorch's FashionMNIST training guide (two conv layers, three
    fully connected).  Fewer parameters than the MLP (44 426) but 2.8x its multiply-adds per sample
    (282 thousand against 102 thousand): more work per step next to smaller gradients, so it scales better."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def build_model(name: str, seed: int) -> nn.Module:
    """The same seed gives the same initial weights in every process."""
    torch.manual_seed(seed)
    return {"mlp": mlp, "cnn": CNN}[name]()


# ------------------------------------------------------------------------------------------ day 3: a ViT

class Block(nn.Module):
    """One transformer block, pre-norm: x + attention(norm(x)), then x + MLP(norm(x)).  Day 3 checkpoints
    and shards the model block by block, so a block is the unit that owns its parameters.
    `qkv` makes every head's query, key and value with one matrix, its rows ordered head by head (head 0's
    q, k, v, then head 1's, ...): cut into T equal pieces of rows, as tensor parallelism cuts it (lesson 19's
    plan), each piece holds whole heads.  Its initial rows are drawn as nn.Linear draws
    them, all queries, then all keys, then all values, and put in that order: the same numbers in each
    head's q, k and v whichever order the rows are kept in.  The forward pass takes the number of heads
    from the tensor it gets (`-1` below), so that the same code runs on all heads or on a rank's share, and
    the number of tokens from qkv's output, so that its input may be a rank's share of the tokens."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 2):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.head_width = width // heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        by_head = torch.arange(3 * width).view(3, heads, self.head_width).transpose(0, 1).reshape(-1)
        with torch.no_grad():  # rows [q of all heads, k ..., v ...] -> [head 0's q, k, v, head 1's ...]
            self.qkv.weight.copy_(self.qkv.weight[by_head])
            self.qkv.bias.copy_(self.qkv.bias[by_head])
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x):
        qkv = self.qkv(self.norm1(x))
        b, t = qkv.shape[:2]  # all the tokens, also where x holds a piece of them (sequence parallel, lesson 19)
        q, k, v = qkv.view(b, t, -1, 3, self.head_width).permute(3, 0, 2, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v)  # [b, heads, t, head_width]
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


def vit_parts(patch: int = 7, width: int = 64, depth: int = 4, heads: int = 4, classes: int = 10):
    """The ViT's parts as (name, module or parameter), in the order its constructor makes them and so draws
    their random numbers.  Made one at a time under the seed of a whole ViT, each part has that ViT's initial
    weights: lesson 15 initializes its shards this way without ever holding more than one block whole."""
    if 28 % patch:
        raise ValueError(f"patch {patch} must divide 28 (1, 2, 4, 7, 14 or 28)")
    yield "embed", nn.Conv2d(1, width, patch, stride=patch)  # each patch -> one token of `width` numbers
    yield "position", nn.Parameter(torch.randn(1, (28 // patch) ** 2, width) * 0.02)
    yield "blocks", nn.ModuleList()
    for i in range(depth):
        yield f"blocks.{i}", Block(width, heads)
    yield "norm", nn.LayerNorm(width)
    yield "head", nn.Linear(width, classes)


class ViT(nn.Module):
    """A small Vision Transformer for 28x28 images: non-overlapping `patch` x `patch` patches become tokens
    (7x7 patches: 16 tokens), each projected to `width` numbers, plus a learned position embedding; `depth`
    blocks (in `self.blocks`, an nn.ModuleList) mix the tokens; the mean token is classified.
    Default size (width 64, depth 4, 4 heads, patch 7): 138 890 parameters."""

    def __init__(self, patch: int = 7, width: int = 64, depth: int = 4, heads: int = 4, classes: int = 10):
        super().__init__()
        for name, part in vit_parts(patch, width, depth, heads, classes):
            parent, _, leaf = name.rpartition(".")  # "blocks.2": the third entry of self.blocks
            setattr(self.get_submodule(parent), leaf, part)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2) + self.position  # [B, tokens, width]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def add_vit_args(p, width: int = 64):
    """Day 3's command line: --model also takes vit (its default there) and the ViT's size is four flags;
    `width` is the default of --width (lesson 15 starts from a wider model)."""
    from course.launching.cli import positive_int

    model = next(a for a in p._actions if a.dest == "model")
    model.choices, model.default = (*model.choices, "vit"), "vit"
    model.help = f"{model.help}; vit: a small Vision Transformer (course/models.py), sized by the flags below"
    p.add_argument("--patch", type=int, default=7, choices=(1, 2, 4, 7, 14), help="ViT patch size (7: 16 tokens)")
    p.add_argument("--width", type=positive_int, default=width, help="ViT token width (a multiple of --heads)")
    p.add_argument("--depth", type=positive_int, default=4, help="ViT blocks")
    p.add_argument("--heads", type=positive_int, default=4, help="ViT attention heads per block")
    return p


# the lessons that only make sense with the ViT, and why
VIT_ONLY = {"18_hardware_limits": "lesson 18 compares the FLOPs it counts with a transformer's formula",
            "19_tensor_parallel": "tensor parallelism cuts the ViT's attention and MLP layers",
            "20_device_mesh_2d": "tensor parallelism cuts the ViT's attention and MLP layers",
            "21_pipeline_parallel": "the pipeline's stages are runs of the ViT's blocks"}


def check_vit_args(args) -> None:
    """The ViT's flags as one clear line, before any rank starts."""
    from course.launching.cli import CourseError

    if args.model != "vit" and getattr(args, "lesson", None) in VIT_ONLY:
        raise CourseError(f"--model {args.model}: {VIT_ONLY[args.lesson]}; use --model vit")
    if args.model == "vit" and args.width % args.heads:
        raise CourseError(f"--width {args.width} is not a multiple of --heads {args.heads}; choose a width "
                          f"such as {args.heads * 16}")


def model_from_args(args, seed: int) -> nn.Module:
    """build_model for the lessons with add_vit_args: the same seed gives the same weights everywhere."""
    if args.model != "vit":
        return build_model(args.model, seed)
    torch.manual_seed(seed)
    return ViT(args.patch, args.width, args.depth, args.heads)


# ------------------------------------------------------------------------------------------ day 4: the plans

def check_tensor_parallel(args, degree: int) -> None:
    """One clear line, before any rank starts, when the ViT's heads do not divide among `degree` ranks, or
    (--sequence-parallel) its tokens do not."""
    from course.launching.cli import CourseError

    if args.heads % degree:
        sizes = [str(n) for n in range(1, args.heads + 1) if args.heads % n == 0]
        sizes = " or ".join([", ".join(sizes[:-1]), sizes[-1]] if len(sizes) > 1 else sizes)
        raise CourseError(f"--heads {args.heads} does not divide among {degree} tensor-parallel ranks (each rank "
                          f"computes whole heads); use {sizes} ranks, or --heads {degree} (or a multiple) with a "
                          f"--width it divides")
    tokens = (28 // args.patch) ** 2
    if getattr(args, "sequence_parallel", False) and tokens % degree:
        fits = [str(p) for p in (1, 2, 4, 7, 14) if ((28 // p) ** 2) % degree == 0]
        raise CourseError(f"--sequence-parallel cuts the {tokens} tokens of --patch {args.patch} into {degree} equal "
                          f"pieces, one per tensor-parallel rank, and {degree} does not divide {tokens}; use --patch "
                          f"{' or '.join(fits)}, or another number of ranks")


class Stage(nn.Module):
    """One pipeline stage of the ViT (lesson 21): a run of consecutive blocks; the first stage also turns the
    images into tokens (embed, position), the last also classifies them (norm, head).  Its parameters keep
    the ViT's names ("blocks.2.qkv.weight"), so the stages' state dicts together are a ViT's.  The forward
    pass is the ViT's, each part where this stage has it."""

    def __init__(self, parts: dict):
        super().__init__()
        self.blocks = nn.ModuleDict()  # keyed by the block's index in the whole ViT
        for name, part in parts.items():
            if name.startswith("blocks."):
                self.blocks[name.split(".")[1]] = part
            else:
                setattr(self, name, part)

    def forward(self, x):
        if hasattr(self, "embed"):  # the first stage: images -> tokens
            x = self.embed(x).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks.values():
            x = block(x)
        if hasattr(self, "head"):  # the last stage: tokens -> logits
            x = self.head(self.norm(x).mean(1))
        return x.contiguous()  # sent to the next stage as laid out: the tokens' transpose above is not contiguous


def pipeline_plan(depth: int, stages: int) -> list:
    """How lesson 21 cuts the ViT into `stages` pipeline stages: the names of the parts each stage holds.
    Consecutive blocks, depth / stages each; stage 0 also holds the embedding, the last stage the norm and
    the head (their compute is small next to a block's)."""
    per = depth // stages
    plan = [[f"blocks.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    plan[0][:0] = ["embed", "position"]
    plan[-1] += ["norm", "head"]
    return plan


def build_stages(args, seed: int, rank: int, ranks: int, device) -> tuple:
    """(this rank's stages as an nn.ModuleList on `device`, their indices, the number of stages).  Stage r of
    p; an interleaved schedule (--schedule interleaved-1f1b) gives each rank 2 stages, placed in a loop as
    torch's interleaved schedules expect: rank r holds stages r and r + p of 2p.  Each stage is built from
    the ViT's parts drawn one at a time in order under `seed` (vit_parts): together the stages hold a whole
    ViT's initial weights at that seed, and no rank ever holds more of the model than its stages and one
    more block."""
    per_rank = 2 if args.schedule.startswith("interleaved") else 1
    ids, stages = [rank + i * ranks for i in range(per_rank)], per_rank * ranks
    plan = pipeline_plan(args.depth, stages)
    torch.manual_seed(seed)
    kept = {s: {} for s in ids}
    for name, part in vit_parts(args.patch, args.width, args.depth, args.heads):
        for s in ids:
            if name in plan[s]:
                kept[s][name] = part
    return nn.ModuleList(Stage(kept[s]) for s in ids).to(device), ids, stages


def check_pipeline(args, ranks: int) -> None:
    """Lesson 21's sizes as one clear line, before any rank starts: the blocks divide among the stages, the
    batch into equal micro-batches (every micro-batch has the shape of the first), and the schedule's own
    rules on the number of micro-batches (torch 2.14.1 raises them only once the ranks have started)."""
    from course.launching.cli import CourseError

    stages = ranks * (2 if args.schedule == "interleaved-1f1b" else 1)
    m = args.microbatches
    if args.depth % stages:
        what = f"{ranks} ranks x 2 stages each" if stages != ranks else f"{ranks} stages (one per rank)"
        raise CourseError(f"--depth {args.depth} blocks do not divide among {what}; use --depth "
                          f"{stages * max(1, args.depth // stages)} or another number of ranks")
    if args.batch_size % m:
        raise CourseError(f"--batch-size {args.batch_size} does not split into {m} equal micro-batches "
                          f"(--microbatches); use a batch size that is a multiple of {m}")
    if args.schedule == "1f1b" and m < ranks:
        raise CourseError(f"--schedule 1f1b needs at least as many micro-batches as stages: --microbatches {m} "
                          f"< {ranks} stages; use --microbatches {ranks} or more (or --schedule gpipe)")
    rounds = max(1, m // ranks)
    if args.schedule == "interleaved-1f1b" and m % rounds:
        raise CourseError(f"--schedule interleaved-1f1b splits the micro-batches into max(1, m // p) = {rounds} "
                          f"rounds of equal size (p = {ranks} ranks): --microbatches {m} is not a multiple of "
                          f"{rounds}; use a multiple of {ranks}")


# ------------------------------------------------------------------------------------------ day 5: a GPT

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
    numbers (see vit_parts): made one at a time under the seed of a whole GPT, each has that GPT's weights.
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
    Llama's names (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ..., lm_head.weight), so
    a state dict of this model is a LlamaForCausalLM's with the same sizes, and back.  Default size (a byte
    vocabulary of 256, width 64, depth 2, 4 heads, MLP hidden 172): 131 904 parameters."""

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
