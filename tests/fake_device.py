"""An emulated accelerator for CPU-only tests: catches host/device mixing bugs without a GPU.

`FakeAccelerator` is a `TorchFunctionMode`. Tensors it marks as living on the accelerator report
`device == cuda:0` (and `is_cuda`), although their storage stays on the CPU. Inside the mode:

- an operation that combines a marked tensor with an unmarked (host) tensor of one or more dimensions raises the
  error CUDA raises (host 0-dim tensors mix freely, as on CUDA; so does indexing a device tensor with host indices);
- results of operations on marked tensors are marked; `.to("cuda")`, `.cuda()` and factories called with a CUDA
  `device=` return marked tensors; `.cpu()` / `.to("cpu")` return unmarked copies;
- every device→host transfer of a marked tensor (`.cpu()`, `.to("cpu")`, `.item()`, `.tolist()`, `int()`,
  `float()`, `bool()`, `.numpy()`) is counted in `transfers`, so a test can bound the synchronisations a code path
  makes.

It emulates placement rules, not CUDA semantics: it is meant for code paths that do tensor arithmetic and indexing
(batch post-processing, samplers), not for running a model.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
_MARK = "_fake_accelerator"
_TRANSFERS = {
    torch.Tensor.cpu,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}
_HOST_INDEX_OK = {torch.Tensor.__getitem__}
_FACTORY_DEVICE_ARG = "device"


def is_marked(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def mark(t):
    if isinstance(t, torch.Tensor):
        setattr(t, _MARK, True)
    return t


def _is_fake(device) -> bool:
    if device is None:
        return False
    if isinstance(device, str | int):
        device = torch.device(device) if isinstance(device, str) else torch.device("cuda", device)
    return isinstance(device, torch.device) and device.type == "cuda"


def _to_target(args, kwargs):
    """The device of a `Tensor.to(...)` call, or None when it only changes dtype."""
    if "device" in kwargs:
        return torch.device(kwargs["device"]) if kwargs["device"] is not None else None
    for a in args[1:]:
        if isinstance(a, torch.device | str):
            return torch.device(a)
        if isinstance(a, torch.Tensor):  # .to(other): other's device
            return FAKE if is_marked(a) else a.device
    return None


class FakeAccelerator(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.transfers = 0

    def to_device(self, tree):
        """Mark every tensor of a (nested) structure as living on the accelerator (in place)."""
        tree_map(mark, tree)
        return tree

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.device:
            return FAKE if is_marked(args[0]) else func(*args, **kwargs)
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.is_cuda:
            return is_marked(args[0]) or func(*args, **kwargs)
        if func is torch.Tensor.to:
            target = _to_target(args, kwargs)
            clean_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            clean_args = tuple(a for a in args if not isinstance(a, torch.device | str))
            if target is not None and _is_fake(target):
                out = func(*clean_args, **clean_kwargs)
                return mark(out.clone() if out is args[0] and not is_marked(args[0]) else out)
            if target is not None and target.type == "cpu" and is_marked(args[0]):
                self.transfers += 1
                out = func(*clean_args, **clean_kwargs)
                return out.clone() if out is args[0] else out
            out = func(*args, **kwargs)
            return mark(out) if is_marked(args[0]) else out
        if func is torch.Tensor.cuda:
            return mark(args[0].clone())
        if func in _TRANSFERS:
            if is_marked(args[0]):
                self.transfers += 1
                if func is torch.Tensor.cpu:
                    return args[0].clone()
            return func(*args, **kwargs)

        factory_on_device = _is_fake(kwargs.get(_FACTORY_DEVICE_ARG))
        if factory_on_device:
            kwargs = {**kwargs, _FACTORY_DEVICE_ARG: "cpu"}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(is_marked(t) for t in tensors)
        host = [t for t in tensors if not is_marked(t) and t.dim() > 0]
        if on_device and host and func not in _HOST_INDEX_OK:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"(in {getattr(func, '__qualname__', func)}, emulated by tests/fake_device.py)"
            )
        out = func(*args, **kwargs)
        if on_device or factory_on_device:
            tree_map(mark, out)
        return out
