"""What a mixture of experts (mingpt_ddp/moe.py) adds to a rank's memory, from its shapes.

The planner's traces cannot run a MoE block: how many rows each expert gets is data (a
bincount, then Python ints), which fake tensors do not have. So a MoE model is calibrated as the
dense model of the same width (memory.calibrate) and this module adds the difference, an even
spread of the tokens over the experts assumed: the experts' parameters this rank holds, and
what moe.py's forward keeps for backward beyond the dense MLP's hidden layer.
"""

from __future__ import annotations

from mingpt_ddp.moe import PAD_ROWS
from mingpt_ddp.planner.shapes import Layout, Model


def expert_elements(model: Model, layout: Layout) -> int:
    """Per block, the expert weights expert parallelism gives this rank (n_experts / ep experts'
    two matrices), which DDP and FSDP leave alone; 0 without ep, where they are shared like any
    other parameter."""
    if not model.n_experts or layout.ep == 1:
        return 0
    return 2 * (model.n_experts // layout.ep) * model.n_embd * model.hidden


def extra_activations(model: Model, layout: Layout) -> float:
    """Bytes a MoE block keeps for backward beyond the dense block calibrate traced, for one
    forward unit (a microbatch's windows, T / cp tokens), read off moe.py's forward: the router's
    scores and its ranking of the experts (N, E), the chosen weights, three orders of the M =
    N x top_k rows (int64), the rows as routed (fp32), each of this rank's experts' group padded
    to PAD_ROWS, its hidden layer's input and output (H wide), the outputs and their placed
    copy; less the dense MLP's two hidden tensors (4C wide, cut by tensor parallelism)."""
    if not model.n_experts:
        return 0.0
    E, k, C, H = model.n_experts, model.top_k, model.n_embd, model.hidden
    tokens, item = layout.micro * (model.block // layout.cp), layout.itemsize
    rows = tokens * k  # under ep the rows a rank computes: as many come as leave, evenly
    padded = rows + E // layout.ep * (PAD_ROWS - 1) / 2  # half a pad per expert on average
    indices = 8 * (tokens * E + 3 * rows)
    fp32 = 4 * (tokens * E + tokens * k + rows * C)
    compute = item * (padded * C + 2 * padded * H + 2 * rows * C)
    dense = item * tokens * 8 * C / layout.tp
    return indices + fp32 + compute - dense
