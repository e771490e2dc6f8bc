"""Tensor parallelism under torch's DDP: the parameters DDP's wrapper moved out of sight.

``DDP(model, device_mesh=mesh["dp"])`` on a model that ``parallelize_module`` split over another
dimension of the same mesh runs torch's ``_pre_dp_module_transform``
(``torch/distributed/tensor/parallel/ddp.py``; torch calls it a temporary workaround): every
DTensor parameter is replaced by a plain ``nn.Parameter`` over its local shard, its layout kept in
the attribute ``_st_info`` (a ``DTensorSpec``), so that DDP's buckets see plain tensors. A forward
pre-hook rebuilds a DTensor from it for the forward and leaves that DTensor behind as a plain
attribute of the submodule. From the first forward on, the tensor-parallel weights are no longer
parameters of the module: ``model.state_dict()`` and ``model.parameters()`` leave them out, while
the optimizer and DDP keep training the local ``nn.Parameter`` objects.

Registered as it is, such a model would carry no tensor-parallel weight to a joining rank (it
would keep its initial shard while its peers trained theirs, silently: the joiner's dp peer
averages the same gradients into a different shard), and before the first forward its local
shards would look replicated across the world. ``LocalizedTP`` is what the runtime carries for
it instead: the module's state dict with each localized parameter put back as the DTensor it
stands for (its local ``nn.Parameter`` with the layout of ``_st_info``), so that replicas are read
off the placements (``state.replicas``: the rank's dp peers with the same ``tp`` coordinate), and
loading copies into the ``nn.Parameter`` the optimizer and DDP hold (the DTensor the forward uses
is a view of it).
"""

from __future__ import annotations

import torch


def localized_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """State-dict key -> local ``nn.Parameter`` of every parameter of ``module`` that DDP x TP's
    wrapper localized: still a parameter (before the first forward), or already left behind as a
    DTensor attribute over a view of it (after). Empty for any other module."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        if getattr(p, "_st_info", None) is not None:
            out[name] = p
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if not isinstance(value, DTensor):
                continue
            base = value._local_tensor._base if value._local_tensor._base is not None else value._local_tensor
            if isinstance(base, torch.nn.Parameter) and getattr(base, "_st_info", None) is not None:
                out[f"{path}.{attr}" if path else attr] = base
    return out


class LocalizedTP:
    """What the runtime carries for a module whose tensor-parallel parameters DDP localized
    (module docstring): its state dict with those parameters as the DTensors they stand for."""

    def __init__(self, module: torch.nn.Module, localized: dict[str, torch.nn.Parameter]):
        self.module = module
        self.localized = localized

    def parts(self) -> list:
        """The module itself: its gradients and DDP reducer are cleared, as a registered module's."""
        return [self.module]

    def state_dict(self) -> dict:
        from torch.distributed.tensor import DTensor

        out = {k: v for k, v in self.module.state_dict().items() if k not in self.localized}
        for key, p in self.localized.items():
            spec = p._st_info
            out[key] = DTensor.from_local(p.detach(), spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
        return out

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in self.localized if k not in state]
        if missing:
            raise KeyError(f"the state has no tensor-parallel parameter(s) {missing}")
        with torch.no_grad():
            for key, p in self.localized.items():
                value = state[key]
                p.copy_(value.to_local() if hasattr(value, "to_local") else value)
        rest = {k: v for k, v in state.items() if k not in self.localized}
        result = self.module.load_state_dict(rest, strict=False)
        wrong = [k for k in result.missing_keys if k not in self.localized] + list(result.unexpected_keys)
        if wrong:
            raise KeyError(f"loading {type(self.module).__name__}: keys that do not match its state: {wrong}")
