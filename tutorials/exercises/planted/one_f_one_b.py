"""Exercise 5, planted wrong: GPipe's order, all forwards first. Every gradient comes out right
and nothing hangs; but the first stage holds every microbatch's activations at once, which the
held-microbatches probe catches."""


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    forwards = [("F", i) for i in range(microbatches)]
    return forwards + [("B", i) for i in range(microbatches)]  # the bug: GPipe, not 1F1B
