"""With ``overlap_param_gather=True`` a step leaves its param all-gathers in flight; the next
``opt.step()`` waits for them (``model.finish_grad_sync()``) before it writes the masters and
casts them back into ``param_data``. gloo completes the gathers before anybody could write, so
no test on the default backend sees a missing wait.

Here every gather runs through the late-gather backend (tests/_habits_models.py's
``LateGathers``, registered through the public collectives seam): a gather lands in its bucket
only when waited for, and one nobody waited for lands when its bucket's next gather starts,
over whatever the step wrote meanwhile. Any path that writes params or masters before waiting
loses those writes, and the params leave torch DDP + the same torch optimizer's. Three
loops, none calling ``model.wait_for_params()``: step and zero_grad; an evaluation forward
under ``torch.no_grad`` between steps; two steps on one backward (nothing but the step itself
waits between them). ZeRO-1 AdamW and layer-wise Muon, 2 ranks and 3 (odd shapes: no bucket
or param a multiple of the world size).
"""

from __future__ import annotations

import torch

from tests._dist import case, make_tests
from tests._habits_models import (
    REL,
    LateGathers,
    TorchDDP,
    backward_on,
    newton_schulz_fp32,
    wrap,
)
from tests.models import assert_params_match, assert_replicas_identical, batch, make_net

STEPS = 4
LOOPS = ("step, zero_grad", "evaluation forward under no_grad", "two steps per backward")


def train(mode: str, loop: str, rank: int, ws: int) -> None:
    """``STEPS`` steps of ``loop`` on aligndp (late gathers, overlapped) and on torch DDP, the
    params compared after each step on every rank."""
    model, opt = wrap(make_net(), mode, overlap_param_gather=True, collectives=LateGathers.name)
    late = model.collectives
    assert isinstance(late, LateGathers), f"the model reduces through {type(late).__name__}"
    ref = TorchDDP(make_net(), mode)
    what = f"{mode}, {loop}"
    for step in range(STEPS):
        for m, o in ((model, opt), (ref.model, ref)):
            backward_on(m, step, rank, ws)
            o.step()
            if loop == "two steps per backward":
                o.step()
            o.zero_grad()
            if loop == "evaluation forward under no_grad":
                with torch.no_grad():
                    m(batch(100 + step, rank, ws)[0])
        assert late.gathers, f"{what}: no param all-gather went through the late-gather backend"
        assert not late.clobbered, (
            f"{what}, step {step}: {late.clobbered} param all-gather(s) were never waited for "
            "before the next step wrote their bucket (model.finish_grad_sync() waits for the "
            "gathers in flight before a step writes the masters)"
        )
        assert_replicas_identical(model.module, f"{what}, step {step}")
        assert_params_match(model.module, ref.module, f"{what}, step {step}", REL)


@case(2, 3)
def case_zero1_adamw_steps_wait_for_the_gathers_in_flight(rank, ws):
    for loop in LOOPS:
        train("zero1", loop, rank, ws)


@case(2, 3)
def case_layerwise_muon_steps_wait_for_the_gathers_in_flight(rank, ws):
    with newton_schulz_fp32("muon zero1"):
        for loop in LOOPS:
            train("muon zero1", loop, rank, ws)


make_tests(globals())
