"""Where and how a process computes: the device (--device auto|cpu|cuda), bf16 autocast and
torch.compile (on with CUDA, off on the CPU unless asked), deterministic kernels and its peak
memory.
"""
import os
import resource

import torch


def add_device_flag(add, what: str = "where to compute") -> None:
    """--device auto|cpu|cuda, declared here for every script (add: a parser's add_argument)."""
    add("--device", default="auto", choices=("auto", "cpu", "cuda"),
        help=f"{what}; auto = cuda if available")


def pick_device(name: str = "auto", index: int | None = None) -> torch.device:
    """--device auto|cpu|cuda -> a device; auto is CUDA when a GPU is visible. `index`: the GPU of
    one DDP process."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda" if index is None else f"cuda:{index}")


def use_bf16(device: torch.device, bf16: bool | None = None) -> bool:
    """Whether to autocast to bfloat16: `bf16` if given, else on with CUDA and off on the CPU
    (where only some CPUs gain from it: see train.py --bf16)."""
    return device.type == "cuda" if bf16 is None else bf16


def use_compile(device: torch.device, compile: bool | None = None) -> bool:
    """Whether to torch.compile: `compile` if given, else on with CUDA and off on the CPU."""
    return device.type == "cuda" if compile is None else compile


def autocast(device: torch.device, bf16: bool | None = None):
    """bfloat16 autocast of the forward pass as use_bf16 decides (a disabled one otherwise);
    weights, optimizer and losses stay float32."""
    return torch.autocast(device.type, torch.bfloat16, enabled=use_bf16(device, bf16))


def use_tf32(device: torch.device) -> None:
    """On a GPU, float32 matrix products (what runs outside bf16 autocast: mlsm's FISTA coder,
    float32 losses) on the tensor cores as TF32, for this process: train.py's setting, which
    bench.py shares where it times what train.py runs."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def use_deterministic():
    """Deterministic kernels only, from here on: a GPU's backward passes that add with atomics
    (in an order that varies from run to run) take their deterministic versions, at some cost
    in speed, and an operation that has none raises rather than vary. cuBLAS needs its
    workspace fixed before its first call (CUDA's reproducibility notes)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def peak_memory_gb(device) -> float:
    """Peak allocated GPU memory, or on a CPU the process' peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
