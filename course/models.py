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
