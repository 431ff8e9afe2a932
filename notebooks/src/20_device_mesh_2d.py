# %% [markdown]
# # Lesson 20: two dimensions: FSDP2 x TP and HSDP on a device mesh
#
# Script: [`day4/20_device_mesh_2d.py`](../day4/20_device_mesh_2d.py).
#
# Lesson 19 cut each block's linear layers over all the ranks; lesson 15 sharded the parameters over all the
# ranks. A real
# cluster has two kinds of links: fast ones between the GPUs of a node (NVLink), slower ones between the
# nodes (InfiniBand, Ethernet). A **2-D device mesh** lays the W ranks out as W/I rows of I consecutive
# ranks (`--inner I`); torchrun and srun number ranks node by node, so with I the ranks per node a row is one
# node, and each parallelism runs along the dimension whose links suit it:
#
# - **FSDP2 x TP** (`--layout fsdp-tp`, mesh dimensions `("dp", "tp")`): each row is a lesson-19
#   tensor-parallel group (`parallelize_module` on `mesh["tp"]`): its 4 all_reduces of activations per
#   block stay inside a node. FSDP2 then shards everything over the columns (`fully_shard` on
#   `mesh["dp"]`): its all_gathers of each block's parameters (in forward, and again in backward) and the
#   reduce_scatter of its gradients cross the nodes. A
#   row's ranks take the same batch; the W/I rows are data-parallel replicas with batches of their own.
# - **HSDP** (`--layout hsdp`, `("replicate", "shard")`): no TP; `fully_shard` given the whole 2-D mesh
#   shards every parameter over the I ranks of a row and keeps one copy per row: the all_gathers and
#   reduce_scatters stay inside a node, and only one all_reduce of each gradient shard per step crosses
#   the nodes, between the rows. Every rank takes its own batch.
# - Every parameter becomes a DTensor; under FSDP2 x TP on **one of two meshes**: what TP cut lives on the
#   (dp, tp) mesh, the rest on the dp mesh. `clip_grad_norm_` cannot add norms across meshes, so the lesson
#   adds each mesh's squared norm and scales each mesh's gradients itself.
# - Before training the ranks gather their node names and rank 0 prints the rows with their nodes: a row
#   that spans two nodes would put the most frequent collectives on the slower link.

# %%
from nbhelpers import *

# The one switch. False: 20 steps on 640 samples, 4 CPU processes. True: the lesson's 2 epochs over the
# whole training set, one process per GPU of this node (an even number of them).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--train-samples", "640", "--max-steps", "20"]
NPROC = full_size_nproc(default=4) if FULL_SIZE else 4
INNER = 2  # ranks per row: two rows of two on 4 ranks
ROWS = NPROC // INNER
WIDTH, DEPTH, HEADS, GLOBAL = 32, 2, 4, 32
# the same weights, global batches, learning rate and gradient clip (at 0.5) in every run
ARGS = ["--width", str(WIDTH), "--depth", str(DEPTH), "--heads", str(HEADS), "--precision", "fp32",
        "--clip-grad-norm", "0.5", "--lr", "0.5", "--seed", "5", "--loader", "memory"]
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("20_device_mesh_2d")

# %% [markdown]
# ## The picture: one mesh, two ways to use it
#
# The ranks of this notebook's runs as a mesh, and which collectives each layout runs along which
# dimension (before anything runs).

# %%
grid = [list(range(r * INNER, (r + 1) * INNER)) for r in range(ROWS)]
show_table([{"row": i, "ranks": ", ".join(map(str, row)), "on a cluster": "one node"} for i, row in enumerate(grid)])
show_table([
    {"layout": "fsdp-tp", "inside a row (I ranks, fast link)": "TP: 2 all_reduces of activations per block forward, "
     "2 backward", "across the rows (W/I ranks, slower link)": "FSDP2: all_gather of each block's parameters "
     "(forward, backward), reduce_scatter of its gradients", "batch": f"one per row: {ROWS} x --batch-size"},
    {"layout": "hsdp", "inside a row (I ranks, fast link)": "FSDP2: all_gather of each block's parameters, "
     "reduce_scatter of its gradients", "across the rows (W/I ranks, slower link)": "one all_reduce of each "
     "gradient shard per step", "batch": f"one per rank: {NPROC} x --batch-size"}])
md(f"Both runs below use a global batch of {GLOBAL}: `--batch-size {GLOBAL // ROWS}` per row under FSDP2 x TP, "
   f"`--batch-size {GLOBAL // NPROC}` per rank under HSDP, against one process with `--batch-size {GLOBAL}`.")

# %% [markdown]
# ## What changed against lesson 19
#
# A 2-D mesh instead of a 1-D one, the TP plan applied on its "tp" dimension, `fully_shard` per block and
# on the root (over "dp", or over the whole mesh for HSDP), a sampler over the data-parallel replicas, the
# gradient clip over two meshes, the node names gathered. The report at the end (`course/measuring/parallel.py`)
# counts each rank's pieces, as in lesson 19.

# %%
show_diff("day4/19_tensor_parallel.py", "day4/20_device_mesh_2d.py")

# %%
show_tagged("day4/20_device_mesh_2d.py")

# %% [markdown]
# ## Run both layouts, and one process
#
# FSDP2 x TP with the lesson's own launcher, HSDP under torchrun, then lesson 18 on one process with the
# global batch.

# %%
run_lesson("day4/20_device_mesh_2d.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL // ROWS),
           "--nproc", str(NPROC), "--inner", str(INNER), "--run-dir", RUN / "fsdp-tp")
run_lesson("day4/20_device_mesh_2d.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL // NPROC),
           "--layout", "hsdp", "--inner", str(INNER), "--run-dir", RUN / "hsdp", nproc=NPROC)
run_lesson("day4/18_hardware_limits.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL), "--sizes-mib", "0.25",
           "--run-dir", RUN / "one", nproc=1)  # one rank: its sweep sends nothing, one small size keeps it short

# %% [markdown]
# ## The same training

# %%
import torch

from course.training.output import load_weights

LABELS = {"fsdp-tp": f"FSDP2 x TP, {ROWS} x {INNER}", "hsdp": f"HSDP, {ROWS} x {INNER}",
          "one": "one process (lesson 18)"}
m = {k: read_json(RUN / k / "metrics.json") for k in LABELS}
flat = {k: torch.cat([v.flatten() for _, v in sorted(load_weights(REPO / RUN / k / "model.pt").items())])
        for k in LABELS}
fig, ax = plt.subplots()
for (k, label), style in zip(LABELS.items(), ("o", "x", "-")):
    ax.plot(range(1, m[k]["steps"] + 1), m[k]["loss_per_step"], style, label=label, alpha=0.8)
ax.set(xlabel="step", ylabel="training loss", title=f"ViT width {WIDTH}, depth {DEPTH}, global batch {GLOBAL}")
ax.legend()
plt.show()
rows = []
for k in ("fsdp-tp", "hsdp"):
    rows.append({"layout": LABELS[k], "global batch": m[k]["global_batch_size"],
                 "largest loss difference (relative)": max(abs(a - b) / abs(b) for a, b in
                                                           zip(m[k]["loss_per_step"], m["one"]["loss_per_step"])),
                 "weights' difference (relative)": ((flat[k] - flat["one"]).norm() / flat["one"].norm()).item(),
                 "test accuracy": f"{m[k]['test_accuracy']:.4f}"})
show_table(rows, floatfmt="{:.2g}")
worst = max(r["weights' difference (relative)"] for r in rows)
md(f"One process reached test accuracy {m['one']['test_accuracy']:.4f} after {m['one']['steps']} steps. "
   + ("Both layouts train what it trains: their weights differ from its by at most "
      f"{worst:.1e} (relative), float32 rounding of sums taken in another order (the row-wise layers' "
      "partial sums, the gradients averaged over the replicas)." if worst < 1e-5 else
      f"The weights differ by up to {worst:.1e} (relative): more than the rounding of a few steps."))

# %% [markdown]
# ## Where the ranks ran, and what each holds

# %%
from course.measuring.memory import MB

for k in ("fsdp-tp", "hsdp"):
    mesh = m[k]["mesh"]
    print(f"{LABELS[k]}: dimensions {mesh['dims']}, rows {mesh['rows']}, nodes {mesh['hosts']}")
show_table([{"layout": LABELS[k], "rank": r, "its pieces MB": b["cut"] / MB, "of the whole MB": b["cut_whole"] / MB,
             "share": b["cut"] / b["cut_whole"], "parameters + gradients + momentum MB": b["total"] / MB}
            for k in ("fsdp-tp", "hsdp") for r, b in enumerate(m[k]["per_rank_bytes"])], floatfmt="{:.4g}")
ft, hs = m["fsdp-tp"]["per_rank_bytes"], m["hsdp"]["per_rank_bytes"]
even = ft[0]["cut_share"] / ft[0]["cut_whole"]
position = 4 * (28 // 7) ** 2 * WIDTH  # the position embedding, [1, tokens, width] in fp32
md(f"All ranks of this notebook run on one machine, so every row is on the same node; under srun on two "
   f"nodes the lesson prints each row's node: check that each row is on one node.\n\n"
   f"Under HSDP each rank holds half of every parameter but one (below): **{min(b['cut'] for b in hs) / hs[0]['cut_whole']:.4f} "
   f"to {max(b['cut'] for b in hs) / hs[0]['cut_whole']:.4f}** of the model, the two ranks of a row the whole "
   f"model between them, and the rows the same. Under FSDP2 x TP the matrices TP cut are split over all "
   f"{NPROC} ranks (1/{INNER} by TP, of which 1/{ROWS} by FSDP2) and the rest over the {ROWS} ranks of a column: "
   f"an even cut would leave {even:.4f} of the model on each rank; the ranks hold "
   f"**{min(b['cut'] for b in ft) / ft[0]['cut_whole']:.4f} to {max(b['cut'] for b in ft) / ft[0]['cut_whole']:.4f}**. "
   f"The difference is one tensor: FSDP2 cuts each parameter along its first dimension, and the position "
   f"embedding's is 1 (its shape is [1, tokens, width]): one rank of each group keeps all "
   f"{position / MB:.4f} MB of it, the other none.")

# %% [markdown]
# ## The collectives of step 1

# %%
show_table([{"layout": LABELS[k], "phase": phase, "collective": op, "calls": n}
            for k in ("fsdp-tp", "hsdp") for phase, ops in m[k]["collectives_step_1"].items()
            for op, n in ops.items()])
c = {k: m[k]["collectives_step_1"] for k in ("fsdp-tp", "hsdp")}
md(f"With {DEPTH} blocks: FSDP2 gathers each block and the root (embedding, position, final norm, head) "
   f"during the forward pass, each just before it runs ({c['hsdp']['forward'].get('all_gather (FSDP2)', 0)} all_gathers), gathers each block "
   f"again for the backward pass ({c['hsdp']['backward'].get('all_gather (FSDP2)', 0)}; the root stays "
   f"gathered) and reduce_scatters each unit's gradients "
   f"({c['hsdp']['backward'].get('reduce_scatter (FSDP2)', 0)}). HSDP adds "
   f"{c['hsdp']['backward'].get('all_reduce (FSDP2)', 0)} all_reduces: each unit's gradient shard averaged "
   f"between the rows. FSDP2 x TP has the same FSDP2 calls, over the columns, and TP's "
   f"{c['fsdp-tp']['forward'].get('all_reduce', 0)} + {c['fsdp-tp']['backward'].get('all_reduce', 0)} "
   f"all_reduces of activations inside each row, lesson 19's 2 + 2 per block.")

# %% [markdown]
# ## What each dimension's collectives cost a step
#
# After training each kind of call of step 1 was sent again on its own group, `mesh.get_group(dim)`: this
# rank's row ("tp", "shard") or column ("dp", "replicate"), with the tensor the step sent, and timed (the
# slowest rank's time per call, as lesson 18 times its sweep); times the calls per step, each dimension's
# cost. "link" says whether the groups along a dimension stay inside one node (from the node names the ranks
# gathered before training).

# %%
show_table([{"layout": LABELS[k], "dimension": r["dim"], "group of rank 0": str(r["group"]),
             "link": "across nodes" if r["inter_node"] else "inside a node", "collective": r["op"],
             "MB": r["bytes"] / 1e6, "calls per step": r["calls"], "ms per call": r["seconds"] * 1e3,
             "busbw GB/s": r["busbw_gbps"], "ms per step": r["seconds_per_step"] * 1e3}
            for k in ("fsdp-tp", "hsdp") for r in m[k]["collectives_priced"]], floatfmt="{:.3g}")
dims = {k: m[k]["collectives_per_dimension"] for k in ("fsdp-tp", "hsdp")}
said = {k: "; ".join(f"\"{dim}\" ({d['ranks']} ranks, {'across nodes' if d['inter_node'] else 'inside one node'}): "
                     f"{d['calls']} calls, {d['bytes'] / 1e6:.3f} MB, {d['seconds'] * 1e3:.1f} ms"
                     for dim, d in dims[k].items()) for k in dims}
md(f"Per step, each dimension's collectives alone: FSDP2 x TP {said['fsdp-tp']} (a step took "
   f"{m['fsdp-tp']['step_seconds'] * 1e3:.0f} ms); HSDP {said['hsdp']} (a step took "
   f"{m['hsdp']['step_seconds'] * 1e3:.0f} ms). The groups are a row ({INNER} ranks) or a column ({ROWS} "
   f"ranks) of the {ROWS} x {INNER} mesh, not all {NPROC}: a collective over all ranks of a two-node job would run at the "
   f"speed of the link between the nodes, whichever dimension sends it. Here every rank is on one machine, so "
   f"every group is inside one node; on the course's two-node Slurm job, with a row per node, the \"tp\" and "
   f"\"shard\" rows stay inside a node and the \"dp\" and \"replicate\" columns cross. Each time is what "
   f"the calls cost alone: on a GPU FSDP2 runs its all_gathers and reduce_scatters (and HSDP's all_reduces) "
   f"on CUDA streams of their own beside the compute, while TP's all_reduces sit between two layers, which "
   f"wait for them.")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/20_device_mesh_2d.md`](../solutions/20_device_mesh_2d.md).
#
# 1. The two ends of the mesh, on 4 ranks with lesson 19's small ViT: `--inner 4 --batch-size 32` (one row:
#    TP over all 4 ranks, FSDP2 over 1) and `--inner 1 --batch-size 8` (four rows of one: FSDP2 over all 4,
#    TP over 1). The first is lesson 19 at 4 ranks: 1/4 of the cut matrices on each rank, TP's all_reduces,
#    no FSDP2 collective; the second is lesson 15's sharding: every parameter cut over the 4 ranks (unevenly
#    where its first dimension does not divide by 4), no all_reduce of activations. Both train what lesson
#    19's exercise 1 trained (the same test loss).
# 2. `--inner 3 --nproc 4`: the lesson stops before any rank starts, with one line saying that 3 does not
#    divide the 4 ranks into rows and which values do.
# 3. HSDP on 4 ranks with `--batch-size 32` against lesson 18's DDP on 2 ranks with `--batch-size 64` (lesson
#    19's exercise 3): the same global batch of 128, the same test loss, weights equal within float32
#    rounding; HSDP's step 1 adds one all_reduce per unit, between the rows.
#
# Next: [lesson 21](21_pipeline_parallel.ipynb): pipeline parallelism, the model cut into stages, one per rank.
