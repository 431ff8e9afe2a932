"""The device check (tests/test_device_check.py): on a CPU-only machine, make a run fail where a GPU run would
fail because a tensor handed to a torch.distributed collective is on the CPU: NCCL serves CUDA tensors only,
gloo takes CPU tensors, and on a CPU run the rank's device is the CPU, so nothing else can tell.

Active in every Python process started with this directory on PYTHONPATH and COURSE_DEVICE_CHECK=1 (Python
imports sitecustomize at start-up: torchrun's workers and spawned processes run it themselves; ranks forked
from a process, or from a fork server, inherit what it installed):
- a TorchFunctionMode marks each tensor that code of the repository (COURSE_DEVICE_CHECK_ROOT, the repository
  by default; .venv and site-packages excluded: torch's own tensors, DDP's, FSDP2's, DCP's, DTensor's and the
  pipeline's, are never marked) creates with a factory (torch.zeros, torch.tensor, torch.arange, ...) without
  a device (no `device=`, no `with torch.device(...)`), with `device="cpu"` written out, or with `.cpu()`;
- the mark follows the tensor through every op whose tensor inputs are all marked (torch.stack of marked
  tensors, `.detach()`, `* 2`: on a GPU run these stay on the CPU too); `.to(device)` and `.cuda()` clear
  it, as does any op that mixes in an unmarked tensor (a GPU tensor there);
- torch.distributed's collectives and point-to-point calls are wrapped: a marked tensor among their tensors
  raises one line that names the call and where the tensor was made ("... would be on the CPU on a GPU run;
  NCCL refuses it").  A rank of the course ends on it with that line (course/launching/supervise.py).
Data loaded from files (torch.from_numpy, torch.load, DataLoader batches) is not created by a factory and is
never marked; moved with .to(device) it would be cleared anyway.  Object collectives (all_gather_object,
broadcast_object_list) pickle their objects and put them on the current device themselves: not checked.
Without COURSE_DEVICE_CHECK=1 this file does nothing (not even import torch).
"""
import linecache
import os
import sys

_ACTIVE = os.environ.get("COURSE_DEVICE_CHECK") == "1"

if _ACTIVE:
    import functools

    import torch
    import torch.distributed
    import torch.distributed.distributed_c10d as c10d
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors
    from torch.utils.weak import WeakIdKeyDictionary

    ROOT = os.path.realpath(os.environ.get("COURSE_DEVICE_CHECK_ROOT")
                            or os.path.join(os.path.dirname(__file__), "..", ".."))
    OUTSIDE = (os.sep + ".venv" + os.sep, os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
    HERE = os.path.realpath(__file__)
    # frames between the code that called torch and this mode: torch's dispatch of Python-level functions and
    # its device context (`with torch.device(...)`)
    DISPATCH = tuple(os.path.realpath(os.path.join(os.path.dirname(torch.__file__), *p)) for p in
                     (("overrides.py",), ("utils", "_device.py")))
    # made from data (a list, a number) without a device: on the CPU.  torch.tensor(t) and torch.as_tensor(t)
    # of a tensor keep t's device: those follow the marks like any op.
    FACTORIES = set(_device_constructors())
    FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
    COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
                   "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "reduce_scatter",
                   "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "gather",
                   "gather_into_tensor", "gather_single", "scatter", "all_to_all", "all_to_all_single", "send",
                   "recv", "isend", "irecv", "batch_isend_irecv")
    marks = WeakIdKeyDictionary()  # tensor -> "where it was made (how)"

    @functools.lru_cache(maxsize=None)
    def _real(filename: str) -> str:
        return os.path.realpath(filename)

    def _in_repository(filename: str) -> bool:
        path = _real(filename)
        return path.startswith(ROOT + os.sep) and not any(part in path for part in OUTSIDE)

    def _site(frame):
        """'path:line' of the frame that called torch (this file's frames and torch's dispatch passed over);
        None if that frame is not the repository's code (torch's own code, a package's)."""
        while frame is not None and _real(frame.f_code.co_filename) in (HERE, *DISPATCH):
            frame = frame.f_back
        if frame is None or not _in_repository(frame.f_code.co_filename):
            return None
        return f"{os.path.relpath(_real(frame.f_code.co_filename), ROOT)}:{frame.f_lineno}"

    def _caller_site(frame):
        """'path:line' of the innermost frame of the repository's code anywhere on the stack (a collective's
        caller may be torch's code, called by the lesson)."""
        while frame is not None:
            if _real(frame.f_code.co_filename) != HERE and _in_repository(frame.f_code.co_filename):
                return f"{os.path.relpath(_real(frame.f_code.co_filename), ROOT)}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"

    def _tensors(value, depth=0):
        """The tensors in an argument: a tensor, a list or tuple of them (one level deep), P2POps' tensors."""
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                yield from _tensors(item, depth + 1)
        elif isinstance(value, c10d.P2POp):
            yield value.tensor

    def _outputs(out):
        if isinstance(out, torch.Tensor):
            return (out,)
        if isinstance(out, (list, tuple)):
            return tuple(t for t in out if isinstance(t, torch.Tensor))
        return ()

    def _cpu_literal(device) -> bool:
        return isinstance(device, str) and device.split(":")[0] == "cpu"

    def _mark(outputs, why: str) -> None:
        for t in outputs:
            if t.device.type == "cpu":  # under `with torch.device("meta")` a factory is not on the CPU
                marks[t] = why

    class DeviceCheck(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func in FACTORIES or func is torch.Tensor.cpu:
                device = kwargs.get("device")
                data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
                if func in FROM_DATA and isinstance(data, torch.Tensor) and device is None:
                    pass  # a tensor's device is kept: follow the marks below
                elif device is None or _cpu_literal(device):
                    site = _site(sys._getframe(1))
                    if site is not None:
                        name = "Tensor.cpu()" if func is torch.Tensor.cpu else f"torch.{func.__name__}"
                        _mark(_outputs(out), f"{site} ({name} without the rank's device)")
                    return out
                else:
                    return out
            if func is torch.Tensor.to or func is torch.Tensor.cuda:
                to = [a for a in (*args[1:], kwargs.get("device"), kwargs.get("other"))
                      if isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool)]
                if func is torch.Tensor.cuda or (to and not isinstance(to[0], torch.Tensor)):
                    for t in _outputs(out):
                        if _cpu_literal(to[0] if to else None):
                            site = _site(sys._getframe(1))
                            if site is not None:
                                marks[t] = f"{site} (Tensor.to('cpu'))"
                        elif t in marks:
                            del marks[t]  # moved to the rank's device: on its GPU on a GPU run
                    return out
            if not len(marks) or not (kwargs.get("device") is None or _cpu_literal(kwargs["device"])):
                return out  # no mark to follow; *_like(t, device=...), t.new_zeros(..., device=...): placed
            inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
            if inputs and all(t in marks for t in inputs):
                ids = {id(t) for t in inputs}
                for t in _outputs(out):
                    if id(t) not in ids and t.device.type == "cpu":
                        marks[t] = marks[inputs[0]]
            return out

    def _error(line: str) -> Exception:
        """A CourseError where the course is importable: a rank of the course then ends with this one line."""
        try:
            from course.launching.cli import CourseError
        except ImportError:
            CourseError = RuntimeError
        return type("DeviceCheckError", (CourseError,), {})(line)

    def _checked(name, call):
        def collective(*args, **kwargs):
            if id(_group_of(args, kwargs)) in fixed_gloo:
                return call(*args, **kwargs)  # gloo on a GPU node too: CPU tensors are its own
            for a in (*args, *kwargs.values()):
                for t in _tensors(a):
                    if t in marks:
                        raise _error(f"device check: dist.{name} at {_caller_site(sys._getframe(1))} got a tensor "
                                     f"made at {marks[t]}: it would be on the CPU on a GPU run; NCCL refuses it")
            return call(*args, **kwargs)
        collective.__wrapped__ = call
        collective.__name__ = collective.__qualname__ = name
        return collective

    # Groups that are gloo on a GPU node too: created by a call whose line names "gloo" (lesson 0's group, lesson
    # 16's saver group), and groups made with the backend of such a default group.  Every other group is
    # NCCL on a GPU node (the lessons' backend_for(device, ...), lesson 1's --backend auto).
    fixed_gloo = set()  # ids of the ProcessGroups

    def _names_gloo(frame) -> bool:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        return "'gloo'" in line or '"gloo"' in line

    def _grouping(name, call):
        def make(*args, **kwargs):
            frame = sys._getframe(1)
            group = call(*args, **kwargs)
            made = c10d._get_default_group() if name == "init_process_group" else group
            backend = kwargs.get("backend", args[0] if args and name == "init_process_group" else None)
            inherits = backend is None and c10d.is_initialized() and id(c10d._get_default_group()) in fixed_gloo
            if made is not None and (inherits or (backend is not None and _names_gloo(frame))):
                fixed_gloo.add(id(made))
            return group
        make.__wrapped__ = call
        make.__name__ = make.__qualname__ = name
        return make

    def _group_of(args, kwargs):
        for a in (*args, *kwargs.values(), *(getattr(a, "group", None) for a in _p2p_ops(args))):
            if isinstance(a, c10d.ProcessGroup):
                return a
        return c10d._get_default_group() if c10d.is_initialized() else None

    def _p2p_ops(args):
        return [op for a in args if isinstance(a, (list, tuple)) for op in a if isinstance(op, c10d.P2POp)]

    for _name in ("init_process_group", "new_group"):
        _call = getattr(c10d, _name)
        setattr(c10d, _name, _grouping(_name, _call))
        setattr(torch.distributed, _name, getattr(c10d, _name))

    for _name in COLLECTIVES:
        _call = getattr(c10d, _name, None)
        if _call is not None:
            _wrapped = _checked(_name, _call)
            setattr(c10d, _name, _wrapped)
            if getattr(torch.distributed, _name, None) is _call:
                setattr(torch.distributed, _name, _wrapped)
    DeviceCheck().__enter__()  # on this thread's mode stack for the life of the process

# COURSE_GROUP_TIMEOUTS=FILE: when a rank ends its process groups (destroy_process_group()), one JSON line per
# group it holds is appended to FILE: the script, the rank, the group's description, the seconds its backend
# waits before it gives up (what torch will enforce) and the default group's (the lesson's --timeout).
if os.environ.get("COURSE_GROUP_TIMEOUTS"):
    import json

    import torch
    import torch.distributed
    import torch.distributed.distributed_c10d as c10d

    def _timeout(group) -> float:
        device = torch.device("cuda" if c10d.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout.total_seconds()

    def _recorded(destroy):
        def destroy_process_group(group=None):
            if group is None and c10d.is_initialized():
                default, lines = c10d._get_default_group(), []
                for pg in list(c10d._world.pg_map):
                    lines.append(json.dumps({"script": os.path.basename(sys.argv[0]), "rank": c10d.get_rank(),
                                             "group": pg.group_desc, "backend": c10d.get_backend(pg),
                                             "timeout": _timeout(pg), "default": _timeout(default)}))
                with open(os.environ["COURSE_GROUP_TIMEOUTS"], "a") as out:
                    out.write("".join(line + "\n" for line in lines))
            return destroy(group)
        destroy_process_group.__wrapped__ = destroy
        return destroy_process_group

    c10d.destroy_process_group = _recorded(c10d.destroy_process_group)
    torch.distributed.destroy_process_group = c10d.destroy_process_group
