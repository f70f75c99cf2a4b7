"""The DDP-in-practice tutorials (docs/ddp-in-practice.md) run with two CPU ranks and show what
they claim: DDP's options, a barrier every step, and accelerate's prepare/backward/reduce/gather.
One run per script (a module fixture shares it between tests); timings are printed, never
asserted (they depend on the machine)."""

import re
import sys

import pytest
from conftest import REPO, free_port, main_command, run

pytestmark = pytest.mark.slow
TUTORIALS = REPO / "tutorials"
# The launch test_launchers.py uses: --multi_gpu is the mode that starts several ranks (it runs
# torchrun); --cpu alone would start one plain process.
ACCELERATE = [
    *("-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"),
    *("--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"),
]


def succeeded(result) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def torchrun(script: str, *args: str) -> str:
    return succeeded(
        run(main_command(2, list(args), script=TUTORIALS / script, torchrun=True), timeout=180)
    )


def per_rank(out: str, pattern: str) -> list[tuple[str, ...]]:
    """The groups of `pattern` on rank 0's line, then on rank 1's."""
    found = [re.search(rf"\[rank {r}\] {pattern}", out, re.M) for r in (0, 1)]
    assert all(found), f"{pattern!r} not printed by both ranks:\n{out}"
    return [m.groups() for m in found]


def on_both_ranks(out: str, text: str) -> bool:
    return out.count(text) == 2


@pytest.fixture(scope="module")
def options() -> str:
    return torchrun("ddp_options.py")


def test_unused_parameters_fail_the_next_forward_unless_ddp_searches_for_them(options):
    # False: no error in iteration 1, but its gradients were not averaged (they differ by rank);
    # the next forward fails. True: no error, both ranks hold the mean, one search per iteration.
    assert on_both_ranks(
        options,
        "find_unused_parameters=False: RuntimeError in iteration 2's forward: "
        "Expected to have finished reduction in the prior iteration before starting a new one.",
    )
    (alone0,), (alone1,) = per_rank(options, r"  iteration 1 finished silently: .* sums to (\S+)")
    (mean0,), (mean1,) = per_rank(options, r"  iteration 1: used.weight.grad sums to (\S+),")
    assert alone0 != alone1 and mean0 == mean1
    assert float(mean0) == pytest.approx((float(alone0) + float(alone1)) / 2, abs=2e-4)
    assert on_both_ranks(options, "find_unused_parameters=True: 3 iterations, no error")
    assert on_both_ranks(
        options, "unused.weight.grad is None; unused parameters: 80 bytes; outputs searched 3 "
    )


def test_static_graph_allows_reentrant_checkpointing_twice_and_never_searches(options):
    assert on_both_ranks(
        options,
        "static_graph=False: RuntimeError in iteration 1's backward: "
        "Expected to mark a variable ready only once.",
    )
    (grad0,), (grad1,) = per_rank(options, r"static_graph=True: 3 iterations, no error; .* (\S+)$")
    assert grad0 == grad1  # averaged
    (unused,) = {
        line.split("] ", 1)[1]
        for line in options.splitlines()
        if "static_graph=True on the unused-layer model" in line
    }  # the same line on both ranks
    assert "find_unused_parameters=False: 3 iterations, no error" in unused
    assert unused.endswith("unused parameters: 80 bytes; outputs searched 0 times")


def test_gradients_are_views_into_the_bucket_only_with_gradient_as_bucket_view(options):
    found = re.findall(
        r"\[rank 0\] gradient_as_bucket_view=(\w+): (\d+)/4 gradients inside .*= (\d+) bytes",
        options,
    )
    views = {flag: (int(inside), int(total)) for flag, inside, total in found}
    # 4680 fp32 gradients = 18720 bytes: two copies without, one (the bucket) with
    assert views == {"False": (0, 2 * 18720), "True": (4, 18720)}


def test_a_barrier_every_step_changes_no_loss():
    out = torchrun("barrier_every_step.py", "20", "2")  # few steps: structure, not timing
    rows = dict(
        re.findall(r"^(with(?:out)? barrier): +[\d.]+ ms/step .*final loss (\S+)$", out, re.M)
    )
    assert set(rows) == {"without barrier", "with barrier"}
    assert rows["without barrier"] == rows["with barrier"]
    assert "losses of all 20 steps identical in all 4 runs: True" in out
    assert "[rank 0] with a barrier before reading: 'written by rank 1'" in out


def test_accelerate_prepares_ddp_and_shares_the_data_on_two_cpu_ranks():
    pytest.importorskip("accelerate")
    port = ["--main_process_port", str(free_port())]
    out = succeeded(
        run([sys.executable, *ACCELERATE, *port, TUTORIALS / "accelerate_step.py"], timeout=240)
    )
    shares = per_rank(
        out,
        r"DistributedType.MULTI_CPU \(gloo\) .* model DistributedDataParallel\(Linear\), "
        r".* loader DataLoaderShard with 4 of the 8 batches: samples (.*)$",
    )
    seen = [
        i
        for (spans,) in shares
        for first, last in (span.split("-") for span in spans.split(", "))
        for i in range(int(first), int(last) + 1)
    ]
    assert sorted(seen) == list(range(64))  # disjoint shares that cover the data
    (own0,), (own1,) = per_rank(out, r"own share: 32 samples, squared error (\S+)")
    total, alone = re.search(
        r"over all ranks (\S+); computed alone on all 64 points (\S+); equal: True", out
    ).groups()
    assert float(total) == pytest.approx(float(own0) + float(own1), abs=1e-5)
    assert total == alone and float(total) > 0
    assert "gather: 64 sample indices, each of 0..63 once: True" in out
    weights = per_rank(out, r"weights after training: (.*)$")
    assert weights[0] == weights[1]
