"""benchmarks/comm_bytes.py counts what the ops really carry: one torchrun run of its demo on 2
gloo ranks (a few seconds), checked against sizes worked out here, plus its tables in process."""

import re

import pytest
import torch
from conftest import REPO, main_command, run

from benchmarks.comm_bytes import OPS, gpt, padded_bytes, ring_sent_bytes

pytestmark = pytest.mark.slow
ROW = re.compile(r"^  (\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)$")


@pytest.fixture(scope="module")
def demo() -> dict[str, dict]:
    """Each "== title" section of the demo's output: {"rows": {(rank, op): (calls, input B,
    sent B)}, "text": the section's other lines}, keyed by the title's first word."""
    cmd = main_command(2, [], script=REPO / "benchmarks" / "comm_bytes.py", torchrun=True)
    result = run(cmd, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    sections: dict[str, dict] = {}
    for line in result.stdout.splitlines():
        if line.startswith("== "):
            section = sections.setdefault(line.split()[1].rstrip(":"), {"rows": {}, "text": ""})
        elif match := ROW.match(line):
            rank, op, _kind, *numbers = match.groups()
            section["rows"][int(rank), op] = tuple(int(x) for x in numbers)
        elif sections:
            section["text"] += line + "\n"
    assert set(sections) == {"known", "DDP", "FSDP2", "pipeline"}, result.stdout
    return sections


def test_known_ops_are_counted_exactly(demo):
    rows = demo["known"]["rows"]
    # all_reduce of 1000 fp32 on 2 ranks: S = 4000 B, ring 2(N-1)/N S = 4000 B, on both ranks
    assert rows[0, "allreduce_"] == rows[1, "allreduce_"] == (1, 4000, 4000)
    # the pair: rank 0 sends 300 fp32, rank 1 receives them and sends nothing
    assert rows[0, "send"] == (1, 1200, 1200)
    assert rows[1, "recv_"] == (1, 1200, 0)
    assert (0, "recv_") not in rows and (1, "send") not in rows
    assert rows[0, "_allgather_base_"] == (1, 1000, 1000)  # (N-1) x its 1000 B shard
    assert rows[0, "_reduce_scatter_base_"] == (1, 1000, 500)  # (N-1)/N x 1000 B
    assert rows[0, "broadcast_"] == (1, 400, 0) and rows[1, "broadcast_"] == (1, 400, 400)
    assert len(rows) == 10  # nothing else: the report's all_gather_object is not counted


def test_ddp_buckets_add_up_to_the_gradients(demo):
    model = gpt()[0]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = demo["DDP"]
    for rank in (0, 1):
        calls, counted, sent = ddp["rows"][rank, "allreduce_"]
        assert calls > 1, "bucket_cap_mb should split the gradients into several buckets"
        assert counted == grads and sent == grads  # 2(N-1)/N = 1 at N = 2
    assert set(ddp["rows"]) == {(0, "allreduce_"), (1, "allreduce_")}
    # bucket by bucket, as DDP itself reports them after its rebuild
    counted, own = re.search(
        r"buckets counted \(B\): \[(.*)\]; DDP's own: \[(.*)\]", ddp["text"]
    ).groups()
    assert counted.split(", ") == own.split(", ")
    assert sum(map(int, counted.split(", "))) == grads
    # the first step's one bucket; the second's forward broadcasts the rebuilt bucket order
    assert "step 1: allreduce_ x1\n" in ddp["text"]
    assert re.search(r"step 2: allreduce_ x\d+, broadcast_ x2\n", ddp["text"])


def test_fsdp_gathers_and_scatters_the_padded_parameters(demo):
    model = gpt()[0]
    padded = padded_bytes(model.parameters(), 2)
    assert padded > sum(p.numel() * 4 for p in model.parameters())  # 65 rows of wte pad to 66
    rows = demo["FSDP2"]["rows"]
    for rank in (0, 1):
        # reduce-scatter: every group's padded gradients once, (N-1)/N of them sent
        assert rows[rank, "_reduce_scatter_base_"] == (3, padded, padded // 2)
        # all-gather: 2 blocks in forward and backward, the root in forward only
        calls, shard, sent = rows[rank, "_allgather_base_"]
        assert calls == 5 and shard == sent
    blocks = sum(padded_bytes(b.parameters(), 2) for b in model.blocks)
    assert shard == blocks + (padded - blocks) // 2  # each block's half twice, the root's once
    for kind in ("all_gather", "reduce_scatter"):
        formula, counted = re.search(
            rf"formula: {kind} (\d+) B .* counted (\d+) B", demo["FSDP2"]["text"]
        ).groups()
        assert formula == counted


def test_pipeline_sends_activations_forward_and_gradients_back(demo):
    rows = demo["pipeline"]["rows"]
    act = 8 * 64 * 4  # the whole batch of 8 x 64 fp32, in 4 microbatches
    assert rows[0, "send"] == rows[1, "send"] == (4, act, act)
    assert rows[0, "recv_"] == rows[1, "recv_"] == (4, act, 0)


def test_ring_formulas_on_four_ranks():
    s = 4000
    assert ring_sent_bytes("all_reduce", s, 4) == 6000  # 2 (N-1)/N S
    assert ring_sent_bytes("all_gather", s, 4) == 12000  # (N-1) s
    assert ring_sent_bytes("reduce_scatter", s, 4) == ring_sent_bytes("all_to_all", s, 4) == 3000
    assert ring_sent_bytes("broadcast", s, 4, is_root=True) == s
    assert ring_sent_bytes("broadcast", s, 4) == ring_sent_bytes("recv", s, 4) == 0
    assert ring_sent_bytes("gather", s, 4) == s and ring_sent_bytes("gather", s, 4, True) == 0


def test_the_table_names_arguments_the_installed_ops_have():
    """A later torch that renames a schema argument fails here, not with a KeyError mid-run."""
    for op, (kind, tensors, root) in OPS.items():
        namespace, name = op.split("::")
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
        names = {a.name for a in schema.arguments}
        assert all(arg is None or arg in names for arg in (tensors, root)), op
        assert names & {"process_group", "group_name"}, op
        assert ring_sent_bytes(kind, 8, 2) >= 0  # every kind has a formula
