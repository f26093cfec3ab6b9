"""Scale calibration for randomly initialised conv vision towers (timm FastViT).

A random FastViT (GELU, squeeze-excite gates, layer scales, attention) either blows up
or collapses to a bias-only, image-independent output depending on the seed. We fix
this LSUV-style: walk the convs/linears in execution order and scale each so that its
output has roughly unit std on a fixed synthetic batch, then scale the projector's
first linear so the projected image features are O(1) like the token embeddings.

Every scale is rounded to a power of two: multiplying by it is exact, and the rounding
makes the result insensitive to last-bit float differences between machines or thread
counts, so checkpoints stay byte-identical.
"""

from __future__ import annotations

import math

_CAL_SIDE = 128


class _Stop(Exception):
    pass


def _pow2_inverse(std: float) -> float:
    return 2.0 ** round(-math.log2(max(std, 1e-30)))


def _output_std(model, module, x) -> float:
    import torch

    box: dict[str, float] = {}

    def hook(_m, _i, out):
        box["std"] = out.float().std().item()
        raise _Stop

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    return box["std"]


def calibrate_vision(tower, projector_in, x, x_native) -> None:
    """LSUV over `tower` (a torch module taking pixel batches) on the small batch `x`, then
    scale `projector_in` for unit-std features on `x_native` (the processor's resolution)."""
    import torch

    order: list = []
    mods = [m for m in tower.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    hooks = [m.register_forward_hook(lambda m, _i, _o: order.append(m)) for m in mods]
    with torch.no_grad():
        tower(x)
    for h in hooks:
        h.remove()
    seen: set[int] = set()
    for m in order:
        if id(m) in seen:
            continue
        seen.add(id(m))
        s = _pow2_inverse(_output_std(tower, m, x))
        with torch.no_grad():
            m.weight.mul_(s)
            if m.bias is not None:
                m.bias.mul_(s)
    with torch.no_grad():
        feats = tower(x_native).last_hidden_state
        projector_in.weight.mul_(_pow2_inverse(feats.float().std().item()))


def calibration_batch(seed: int, mean: list[float], std: list[float], side: int = _CAL_SIDE):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.rand((2, 3, side, side), generator=g)
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return (x - m) / s
