"""Initial weights for a model sharded or cut while it was still on the meta device (lessons 15, 16, 19, 20).

`fully_shard` (or `parallelize_module`, or both) on a model built under `torch.device("meta")` gives every
parameter its shape and its placements but no memory; `model.to_empty(device=...)` then allocates this rank's
shards (and, whole, the parameters tensor parallelism leaves plain), uninitialized.
What goes into them here: the weights the same seed gives an unsharded ViT (lesson 13's), made on the CPU
one part at a time in the order the ViT's constructor makes them (course.models.vit_parts), so that the
random numbers come out in the same order.  Each rank keeps its own rows of each part and drops the rest:
no rank holds more than one block whole, and nothing is sent between ranks.

Why not `reset_parameters()` on the shards: each rank would draw its rows from its own generator, not the
rows an unsharded build draws (torch 2.14.1's DTensor random ops coordinate ranks on CUDA-like devices only,
and their numbers still differ from the CPU's).  Large models are often initialized from a seed checkpoint
instead: written once by one process with enough CPU memory, then read back with DCP (lesson 16), each rank
reading only its rows.
"""
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from course.models import vit_parts


def init_vit_shards(model: nn.Module, args, seed: int) -> None:
    """Fill `model`'s shards (after to_empty) with the initial weights of model_from_args(args, seed)."""
    init_shards(model, vit_parts(args.patch, args.width, args.depth, args.heads), seed)


@torch.no_grad()
def init_shards(model: nn.Module, parts, seed: int) -> None:
    """Fill `model`'s shards (after to_empty) with the weights of the model whose constructor makes `parts`
    ((name, module or parameter), in its order) under `seed`: lesson 22's GPT (course.gpt.gpt_parts) and the
    ViT alike."""
    torch.manual_seed(seed)  # as the whole model's builder does before its constructor
    for name, part in parts:
        tensors = {name: part} if isinstance(part, nn.Parameter) else \
            {f"{name}.{key}": value for key, value in part.state_dict().items()}
        for key, whole in tensors.items():
            shard = model.get_parameter(key)
            if not isinstance(shard, DTensor):  # a parameter left plain (tensor parallelism's embedding, norms, head)
                shard.copy_(whole)
                continue
            # this rank's piece, cut as its placements say (fully_shard's rows: rank 0 the largest); no communication
            rows = distribute_tensor(whole.to(shard.device), shard.device_mesh, shard.placements, src_data_rank=None)
            shard.to_local().copy_(rows.to_local())
