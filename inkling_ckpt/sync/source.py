"""A checkpoint's weights as a trainer holds them: Megatron names, BF16 experts (tests, examples, dry runs)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..convert.experts import decode_slice
from ..errors import PlanError
from ..model.inventory import expert_stacks
from ..model.mapping import DEFAULT_PRESET, MegatronMapping, Preset
from .api import EXPERT_NAME_FORMS, expert_param_name


def trainer_tensors(ckpt, *, experts: tuple[int, int] | None = None, form: str = "stacked",
                    preset: str | Preset = DEFAULT_PRESET, select: str = "all",
                    device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """``(megatron_name, tensor)`` of a release checkpoint as one trainer rank would hold them.

    Routed experts are decoded to BF16 (what the trainer trains) and de-interleaved to
    Megatron's ``linear_fc1`` order; ``experts`` = (first, last) keeps only that EP rank's
    experts (local index 0 = global ``first``); ``form`` names them as in
    :data:`~inkling_ckpt.sync.api.EXPERT_NAME_FORMS` (``stacked``, ``grouped``, ``sequential``).
    One layer's tensors are in memory at a time.
    """
    if form not in EXPERT_NAME_FORMS:
        raise PlanError(f"unknown expert name form {form!r}; known: {', '.join(EXPERT_NAME_FORMS)}")
    m = MegatronMapping(ckpt.cfg, preset, dtypes=ckpt.dtypes())
    stacks = {st.name: st for st in expert_stacks(ckpt.cfg, ckpt.plan)}
    E = ckpt.cfg.n_routed_experts
    lo, hi = experts if experts is not None else (0, E)
    for e in m.entries():
        if e.stacked:
            if select == "non-experts":
                continue
            t = m.to_megatron(e.key, decode_slice(ckpt, stacks[e.hf], lo, hi)).to(device)
            if form == "stacked":
                yield expert_param_name(e.key, form), t
            else:
                for j in range(hi - lo):
                    yield expert_param_name(e.key, form, j), t[j]
        elif select != "experts":
            yield e.key, m.to_megatron(e.key, ckpt.get(e.hf)).to(device)
