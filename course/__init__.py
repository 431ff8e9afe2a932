"""Plumbing the lessons share.  The distributed idea each lesson teaches stays inline in that lesson; only what
repeats unchanged lives here, grouped by what it is for:

    course/launching/    the command line and its checks; who started us (torchrun, srun or --nproc), each
                         rank's device and backend, where rank 0 listens, the ranks of --nproc supervised;
                         what a lesson needs from the Python environment
    course/training/     the training loop's helpers: outputs of a run, evaluation, --precision, replicas
                         compared, samples counted, reference curves, shards initialized from the seed
    course/checkpoints/  lesson 12's checkpoint files (files.py) and lesson 16's sharded ones (dcp.py)
    course/measuring/    what a step costs and holds: memory, timing, the profiler, the hardware monitor,
                         bandwidth and FLOPs, the collectives and the pipeline's bubble, hangs explained
    course/models.py     the course's models, and the pipeline stages' split the benchmark builds with (the
                         lessons write their plans themselves): the model's definition does not change

and the commands a trainer or learner runs: day1_sequence.py (the course's main job), fit.py ("will it
fit?": memory per rank for each layout, before the queue), readiness.py (the cluster's readiness check),
sizing.py (how many nodes a class needs), tensorboard_private.py.

Imports go one way, with no circle: launching needs nothing else of the course; models uses launching's
command line alone; training uses those two; checkpoints and measuring use those three.
"""
