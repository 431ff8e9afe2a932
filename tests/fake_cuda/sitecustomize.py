"""The readiness check's tests (tests/test_readiness.py): a node of a GPU cluster, simulated on a CPU machine, for
the real rank step (`python course/readiness.py rank`), which reads what torch and the environment answer.

Active in every Python process started with this directory on PYTHONPATH, for each variable that is set (none
set: this file does nothing, not even import torch):
  COURSE_FAKE_HOST=node1            socket.gethostname() answers it: two "nodes" on one machine
  COURSE_FAKE_GPU=NAME|MAJOR.MINOR|N  torch.cuda answers as a node with N GPUs NAME of that compute capability:
                                    is_available, device_count, get_device_properties (name, major, minor, uuid),
                                    get_device_capability, get_device_name, set_device, current_device and
                                    is_bf16_supported (native from 8.0 on, emulated below: torch's own rule).
                                    A GPU's UUID is made from the host and its entry in CUDA_VISIBLE_DEVICES,
                                    as a real GPU's is its own whatever a process numbers it
  COURSE_FAKE_TORCH=2.5.1           torch's release: its metadata (what course/launching/requires.py reads) and
                                    torch.__version__
  COURSE_FAKE_MISSING=h5py,psutil   these packages are not installed (importlib.util.find_spec finds none)
"""
import os
import sys

if os.environ.get("COURSE_FAKE_HOST"):
    import socket

    socket.gethostname = lambda: os.environ["COURSE_FAKE_HOST"]

for _name in filter(None, os.environ.get("COURSE_FAKE_MISSING", "").split(",")):
    sys.modules[_name] = None  # find_spec answers None, import raises ImportError

if os.environ.get("COURSE_FAKE_TORCH"):
    import importlib.metadata

    _version = importlib.metadata.version
    importlib.metadata.version = lambda name: (os.environ["COURSE_FAKE_TORCH"] if name == "torch" else _version(name))
    import torch

    torch.__version__ = os.environ["COURSE_FAKE_TORCH"]

if os.environ.get("COURSE_FAKE_GPU"):
    import uuid
    from types import SimpleNamespace

    import torch

    _gpu_name, _capability, _count = os.environ["COURSE_FAKE_GPU"].split("|")
    _major, _minor = map(int, _capability.split("."))
    _current = [0]

    def _index(device=None) -> int:
        if device is None:
            return _current[0]
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
        if not 0 <= index < int(_count):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def _properties(device=None):
        index = _index(device)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        physical = visible[index] if index < len(visible) and visible[index] else str(index)
        return SimpleNamespace(name=_gpu_name, major=_major, minor=_minor, total_memory=80 * 2 ** 30,
                               uuid=uuid.uuid5(uuid.NAMESPACE_DNS, f"{socket_host()}/gpu{physical}"))

    def socket_host() -> str:
        import socket

        return socket.gethostname()

    def _set_device(device) -> None:
        _current[0] = _index(device)

    torch.cuda.is_available = lambda: int(_count) > 0
    torch.cuda.device_count = lambda: int(_count)
    torch.cuda.get_device_properties = _properties
    torch.cuda.get_device_capability = lambda device=None: (_properties(device).major, _properties(device).minor)
    torch.cuda.get_device_name = lambda device=None: _properties(device).name
    torch.cuda.set_device = _set_device
    torch.cuda.current_device = lambda: _current[0]
    torch.cuda.is_bf16_supported = lambda including_emulation=True: _major >= 8 or including_emulation
